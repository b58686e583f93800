#!/usr/bin/env bash
# One short GPU check for a lent device machine (about 5 minutes): the gpu-marked tests, a bf16
# training run of llama-160m with NVML energy, and the measured matmul peak. Results land in
# $OUT (or ./gpu_check_out) for the session to read.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu_check_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MLFLOW_TRACKING_URI="sqlite:///$OUT/mlflow.db" CODECARBON_LOG_LEVEL=error
python3 -m pip install -q -e '.[dev]' 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/nvidia_smi.txt"
python3 -m pytest -q -m gpu 2>&1 | tee "$OUT/pytest_gpu.txt"
python3 -m mlflow_llmeff peak --dtype bf16 --device cuda --json 2>&1 | tee "$OUT/peak.json"
python3 -m mlflow_llmeff train --model llama-160m --dataset synthetic --seq-len 1024 --micro-batch-size 8 \
  --max-steps 30 --log-every-n-steps 10 --precision bf16 2>&1 | tail -5 | tee "$OUT/train.txt"
python3 - <<'PY' 2>&1 | tee "$OUT/summary.txt"
import mlflow
r = mlflow.MlflowClient().search_runs(["0"])[0]
for k, v in sorted(r.data.metrics.items()):
    if k.startswith(("summary/", "energy/")):
        print(f"{k} = {v:.6g}")
for k in ("llmeff.accelerator.name", "llmeff.peak.tflops", "llmeff.peak.source", "llmeff.energy.source"):
    print(k, "=", r.data.tags.get(k))
PY
