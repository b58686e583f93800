"""Before a run is paid for: the plan, the fit check, predictions from earlier runs."""
