"""Run comparison: pure calculators (``calc``), reading runs (``source``), figures (``plots``), report
files (``render``), ``llmeff compare`` (``compare``) and the efficiency page of ``mlflow server`` (``server``)."""
