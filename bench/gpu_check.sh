#!/usr/bin/env bash
# One short GPU check for a lent device machine (about 6 minutes on one GPU, 9 on two): the
# gpu-marked tests, a bf16 training run of llama-160m with NVML energy, the measured matmul peak,
# and what CPU cannot check of the parallelism strategies (docs/parallelism.md): FSDP2 in bf16 on
# one GPU with its sharded checkpoint, the link NVML reports and its datasheet peak, and with two
# or more GPUs NCCL bus bandwidth (ddp), ZeRO-2 and tensor parallelism. Results land in $OUT (or
# ./gpu_check_out) for the session to read; every step runs even when an earlier one fails, and
# the script exits 1 at the end naming the steps that failed ("NOT MET: ..."), 0 when all ran.
set -uo pipefail
failed=()
check() { [ "$1" -eq 0 ] || failed+=("$2 (exit $1)"); }
cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu_check_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MLFLOW_TRACKING_URI="sqlite:///$OUT/mlflow.db" CODECARBON_LOG_LEVEL=error
python3 -m pip install -q -e '.[dev]' 2>&1 | tail -2
python3 -m pip install -q -e '.[deepspeed]' 2>&1 | tail -2   # after torch: keeps the machine's CUDA build
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/nvidia_smi.txt"
nvidia-smi topo -m 2>&1 | tee "$OUT/topo.txt"
python3 -m pytest -q -m gpu 2>&1 | tee "$OUT/pytest_gpu.txt"; check "${PIPESTATUS[0]}" "gpu tests"
python3 -m mlflow_llmeff peak --dtype bf16 --device cuda --json 2>&1 | tee "$OUT/peak.json"; check "${PIPESTATUS[0]}" peak
python3 -m mlflow_llmeff train --model llama-160m --dataset synthetic --seq-len 1024 --micro-batch-size 8 \
  --max-steps 30 --log-every-n-steps 10 --precision bf16 --experiment-name gpu-single 2>&1 | tail -5 | tee "$OUT/train.txt"
check "${PIPESTATUS[0]}" "bf16 train"

# FSDP2 in bf16 on one GPU (a process group of one, through accelerate launch), sharded checkpoint
python3 -m mlflow_llmeff train --model llama-160m --dataset synthetic --seq-len 1024 --micro-batch-size 8 \
  --max-steps 20 --log-every-n-steps 5 --precision bf16 --parallelism fsdp --num-processes 1 \
  --checkpoint-dir "$OUT/ck_fsdp" --experiment-name gpu-fsdp 2>&1 | tail -5 | tee "$OUT/train_fsdp.txt"
check "${PIPESTATUS[0]}" "fsdp train"
ls -la "$OUT"/ck_fsdp/step_*/dcp 2>&1 | tee "$OUT/ck_fsdp.txt"

# the link the collectives would cross and its datasheet peak (NVML: NVLink state/version, PCIe)
python3 - <<'PY' 2>&1 | tee "$OUT/link.txt"
import torch
from mlflow_llmeff.meters import commprobe
n = torch.cuda.device_count()
print("cuda devices:", n, torch.cuda.get_device_name(0))
print("nvml nvlink (version, links), pcie (gen, width):", commprobe._nvml_links(0))
peak, why = commprobe.detect_link(torch.device("cuda", 0), backend="nccl", nodes=1, devices_per_node=n)
print("peak:", peak, why)
PY
check "${PIPESTATUS[0]}" link

NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$NGPU" -ge 2 ]; then
  # NCCL bus bandwidth (the probe at start), exposed communication and bytes, for three strategies
  for s in ddp deepspeed_zero2 tp; do
    python3 -m mlflow_llmeff train --model llama-160m --dataset synthetic --seq-len 1024 --micro-batch-size 4 \
      --max-steps 20 --log-every-n-steps 5 --precision bf16 --parallelism "$s" --num-processes 2 \
      --experiment-name "gpu-$s" 2>&1 | tail -4 | tee "$OUT/train_$s.txt"
    check "${PIPESTATUS[0]}" "$s train"
  done
else
  echo "one GPU: NCCL bus bandwidth, ZeRO and tensor parallelism need two (NCCL refuses two ranks on one GPU)" \
    | tee "$OUT/multi_gpu.txt"
fi

python3 - <<'PY' 2>&1 | tee "$OUT/summary.txt"
import mlflow
c = mlflow.MlflowClient()
unfinished = []
for exp in c.search_experiments():
    for r in c.search_runs([exp.experiment_id]):
        print(f"== {exp.name} {r.info.status} {r.data.tags.get('llmeff.parallelism.strategy')}")
        if r.info.status != "FINISHED":
            unfinished.append(f"{exp.name} {r.info.status}")
        for k, v in sorted(r.data.metrics.items()):
            if k.startswith(("summary/", "energy/", "comm/")):
                print(f"{k} = {v:.6g}")
        for k in ("llmeff.accelerator.name", "llmeff.peak.tflops", "llmeff.peak.source", "llmeff.energy.source",
                  "llmeff.parallelism.dp", "llmeff.parallelism.dp_shard", "llmeff.parallelism.tp",
                  "llmeff.comm.peak_gbps", "llmeff.comm.peak.source", "llmeff.comm.probe", "llmeff.comm.sampled",
                  "llmeff.hfu.method", "llmeff.error"):
            print(k, "=", r.data.tags.get(k))
if unfinished:
    raise SystemExit("runs not FINISHED: " + ", ".join(unfinished))
PY
check "${PIPESTATUS[0]}" summary
if [ "${#failed[@]}" -gt 0 ]; then
  echo "NOT MET: $(IFS=';'; echo "${failed[*]}")" | tee "$OUT/verdict.txt"
  exit 1
fi
echo "met: every step ran" | tee "$OUT/verdict.txt"
