"""Pure arithmetic of the standard: FLOPs, throughput, stability, goodput, communication, cost.

Standard library, numpy/scipy and :mod:`mlflow_llmeff.names` only: no torch, mlflow, psutil or pynvml
(``tests/test_architecture.py`` enforces it)."""
