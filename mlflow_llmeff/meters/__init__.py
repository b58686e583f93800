"""Readers of devices and processes: energy, hardware, carbon, contention, communication, FLOP counting.

Never imports mlflow (``tests/test_architecture.py`` enforces it)."""
