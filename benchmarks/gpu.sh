#!/usr/bin/env bash
# NumGuard overhead on one CUDA GPU: a ~134M-parameter transformer LM in bf16-mixed, every variant
# of `python -m benchmarks.overhead` interleaved, timed with CUDA events (under 5 minutes); then the
# compiled model of `python -m benchmarks.compiled` (Triton kernels and dynamo graphs with and without
# the guard at 2, 8 and 32 blocks, counts only, a few minutes of compiling). Not run yet: written for
# one CUDA device, without one at hand.
#
#   benchmarks/gpu.sh OUTDIR
#
# Needs python3 with torch (CUDA), pytorch-lightning, torchmetrics and tensorboard; no network:
# it runs this checkout as `python3 -m benchmarks.overhead` from the repository root, with the root on
# PYTHONPATH too (nothing is installed or downloaded) and makes its data
# in process. Writes OUTDIR/overhead.json, OUTDIR/overhead.md, OUTDIR/run.log, OUTDIR/compiled.md,
# OUTDIR/compiled.log (and OUTDIR/nvidia-smi.txt when nvidia-smi exists).
set -euo pipefail

if [ "$#" -ne 1 ]; then
    echo "usage: $0 OUTDIR" >&2
    exit 2
fi
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$1"
OUTDIR="$(cd "$1" && pwd)"

if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi 2>&1 | tee "$OUTDIR/nvidia-smi.txt" || true
else
    echo "nvidia-smi not found; continuing"
fi

export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
cd "$REPO"

python3 - <<'PY'
import sys

import pytorch_lightning
import torch
import torchmetrics

import lightning_numguard

print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"pytorch_lightning {pytorch_lightning.__version__}, torchmetrics {torchmetrics.__version__}, "
      f"lightning_numguard {lightning_numguard.__version__} from {lightning_numguard.__file__}")
if not torch.cuda.is_available():
    sys.exit("gpu.sh: torch.cuda.is_available() is False")
print(f"device: {torch.cuda.get_device_name(0)}")
PY

# --budget-s keeps the whole run (timed rounds, host-read counts, cProfile, micro) inside ~4.5 min;
# rounds beyond what fits are dropped, never fewer than 2.
python3 -m benchmarks.overhead \
    --device cuda --precision bf16-mixed --lm-size 100m --models lm \
    --rounds 6 --steps 30 --warmup 8 --count-steps 6 --micro-reps 30 \
    --budget-s 240 --profile --out "$OUTDIR" 2>&1 | tee "$OUTDIR/run.log"

# Inductor's own counts on CUDA (Triton kernels: one per launch), the same table as docs/performance.md's
# "Compiled models" on the CPU; the graph caches are off inside the command, so every kernel is generated.
python3 -m benchmarks.compiled --device cuda --blocks 2,8,32 --steps 20 \
    --out "$OUTDIR/compiled.md" 2>&1 | tee "$OUTDIR/compiled.log"

echo "gpu.sh: results in $OUTDIR/overhead.json, $OUTDIR/overhead.md and $OUTDIR/compiled.md"
