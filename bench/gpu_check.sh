#!/usr/bin/env bash
# The GPU checks of issue 31 as one prepared script, for a machine with a CUDA device (a few minutes on one GPU):
# tests/gpu (one full round of tiny under bf16 autocast and torch.compile, checkpoint save/load, the peak bound,
# the start-up refusal on the device) and bench/gpu.py (tokens/s, MFU, peak memory per preset up to the largest
# that fits, one exchange's staging). Results go to $OUT (default runs/gpu-check-<time>): pytest's log, gpu.json
# and bench.log; copy the table into docs/gpu.md. `make gpu-check` runs it.
#   bench/gpu_check.sh [OUT] [extra bench/gpu.py flags, e.g. --presets tiny,small,medium --steps 10]
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${1:-runs/gpu-check-$(date +%Y%m%d-%H%M%S)}
shift || true
mkdir -p "$OUT"
"$PY" -c 'import torch, sys; ok = torch.cuda.is_available(); print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0) if ok else "NO CUDA DEVICE"); sys.exit(0 if ok else 3)' | tee "$OUT/device.txt" || { echo "no CUDA device: nothing to check" >&2; exit 3; }
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
timeout 900 "$PY" -m pytest -q -p no:randomly -p no:cacheprovider -rs tests/gpu 2>&1 | tee "$OUT/tests-gpu.log"
t=${PIPESTATUS[0]}
timeout 900 "$PY" bench/gpu.py --json "$OUT/gpu.json" "$@" 2>&1 | tee "$OUT/bench.log"
b=${PIPESTATUS[0]}
echo "tests/gpu exit=$t bench/gpu.py exit=$b results in $OUT"
exit $((t || b))
