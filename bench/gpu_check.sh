#!/usr/bin/env bash
# One short GPU check for a lent device machine (about 5 minutes on one GPU): the gpu-marked tests,
# the measured matmul peak, llmeff's figures against references (bench/gpu_reference.py: a Llama-1B bf16
# run of llmeff train beside a bare PyTorch loop of the same model, tokens/s ratio and MFU by hand from
# the datasheet), and what CPU cannot check of the parallelism strategies (docs/parallelism.md): FSDP2 in
# bf16 on one GPU with its sharded checkpoint, the link NVML reports and its datasheet peak, and with two
# or more GPUs NCCL bus bandwidth (ddp), ZeRO-2 and tensor parallelism. Results land in $OUT (or
# ./gpu_check_out) for the session to read; every step runs even when an earlier one fails, and
# the script exits 1 at the end naming the steps that failed ("NOT MET: ..."), 0 when all ran.
#
# The device machine reaches no package index: what its image lacks (MLflow, codecarbon, datasets, ...)
# travels as wheels in ./.whl (see docs/training.md, "A GPU check"), installed into a folder that a .pth
# file appends to sys.path, so the image's own torch, numpy and pandas stay first.
set -uo pipefail
failed=()
check() { [ "$1" -eq 0 ] || failed+=("$2 (exit $1)"); }
cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu_check_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MLFLOW_TRACKING_URI="sqlite:///$OUT/mlflow.db" CODECARBON_LOG_LEVEL=error
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/llmeff-site .whl/*.whl 2>&1 | tail -2
  echo /tmp/llmeff-site > "$(python3 -c 'import site; print(site.getsitepackages()[0])')/llmeff-carried.pth"
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -2
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the package from this checkout even if -e failed
else
  python3 -m pip install -q -e '.[dev]' 2>&1 | tail -2
  python3 -m pip install -q -e '.[deepspeed]' 2>&1 | tail -2   # after torch: keeps the machine's CUDA build
  python3 -m pip install -q -e '.[bnb]' 2>&1 | tail -2   # the 8-bit optimizer lever's CUDA path (tests/test_train_gpu.py)
fi
python3 -c "import torch, transformers, accelerate, mlflow; print('torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'mlflow', mlflow.__version__)" 2>&1 | tee "$OUT/versions.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/nvidia_smi.txt"
nvidia-smi topo -m 2>&1 | tee "$OUT/topo.txt"
timeout 240 python3 -m pytest -q -p no:cacheprovider -n 0 -m gpu tests/test_train_gpu.py tests/test_hardware.py tests/test_gpu_conditions.py 2>&1 | tee "$OUT/pytest_gpu.txt"
check "${PIPESTATUS[0]}" "gpu tests"
timeout 120 python3 -m mlflow_llmeff peak --dtype bf16 --device cuda --json 2>&1 | tee "$OUT/peak.json"; check "${PIPESTATUS[0]}" peak
# llmeff train beside a bare loop of the same Llama-1B in bf16: tokens/s ratio and MFU against the datasheet
timeout 300 python3 bench/gpu_reference.py --out "$OUT" 2>&1 | tee "$OUT/reference.txt"
check "${PIPESTATUS[0]}" reference

# FSDP2 in bf16 on one GPU (a process group of one, through accelerate launch), sharded checkpoint
timeout 180 python3 -m mlflow_llmeff train --model llama-160m --dataset synthetic --seq-len 1024 --micro-batch-size 8 \
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
