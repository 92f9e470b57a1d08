#!/usr/bin/env bash
# The GPU checks (issue 22), for a session lent a device machine (one GPU, its own python3 with
# CUDA torch; pydantic and its needs carried as wheels in .whl/, see the device tool's README):
#   bash ci/gpu-check.sh     (writes its logs to $OUT, or /tmp/gpu-out)
#   GPU_STEPS="0 5 6" bash ci/gpu-check.sh    (only those steps)
# Each check prints "=== name" and what it saw; nothing here runs in CI (no GPU there).
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
STEPS=" ${GPU_STEPS:-0 1 2 3 4 5 6 7} "
step() { echo; echo "=== $*"; }
want() { [[ "$STEPS" == *" $1 "* ]]; }
train() { timeout 180 python3 -m ddpkit run --nproc-per-node 1 examples/train.py --epochs 2 "$@"; }

if want 0; then
step "0. the machine"
python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(), 'nccl', torch.cuda.nccl.version())"
fi

if want 1; then
step "1. examples/train.py on CUDA/NCCL, one process, uninterrupted"
train >"$OUT/ref.log" 2>&1; echo "rc=$?"
grep -E "ddpkit:|eval:|sha256|Error" "$OUT/ref.log"
fi

if want 2; then
step "2. the same stopped by SIGTERM after its first checkpoint, then run again (resume)"
rm -rf /tmp/ck
train --checkpoint-dir /tmp/ck --checkpoint-every 20 --step-delay 0.02 >"$OUT/stop.log" 2>&1 &
run=$!
for _ in $(seq 600); do ls /tmp/ck/ckpt-*.pt >/dev/null 2>&1 && break; sleep 0.1; done
kill -TERM "$run"; wait "$run"; echo "stopped: rc=$?"
train --checkpoint-dir /tmp/ck --checkpoint-every 20 >"$OUT/resume.log" 2>&1; echo "rc=$?"
grep -E "resumed|eval:|sha256|Error" "$OUT/resume.log"
ref=$(grep -o "sha256: [0-9a-f]*" "$OUT/ref.log"); got=$(grep -o "sha256: [0-9a-f]*" "$OUT/resume.log")
[ -n "$ref" ] && [ "$ref" = "$got" ] && echo "RESUME BITWISE: same weights" || echo "RESUME DIFFERS: $ref vs $got"
fi

if want 3; then
step "3. two processes on the one GPU"
timeout 120 python3 -m ddpkit run --nproc-per-node 2 examples/train.py --epochs 1 >"$OUT/two.log" 2>&1
echo "rc=$?"; grep -E "ddpkit|Error|error" "$OUT/two.log" | head -12
fi

if want 4; then
step "4. ddpkit doctor (NCCL sweep)"
timeout 120 python3 -m ddpkit doctor --quick >"$OUT/doctor.log" 2>&1; echo "rc=$?"; tail -25 "$OUT/doctor.log"
fi

if want 5; then
step "5. wrap: SyncBatchNorm, bf16 autocast; async checkpoint from GPU memory; watchdog + hang record on NCCL"
timeout 180 python3 -m ddpkit run --nproc-per-node 1 ci/gpu_checks.py --dir /tmp/gck >"$OUT/checks.log" 2>&1
echo "rc=$?"; cat "$OUT/checks.log" | grep -v "^\s*$" | tail -30
fi

if want 6; then
step "6. GPU benchmarks: the training loop (ResNet-style CNN), plain DDP / ddpkit / Accelerate / Fabric"
timeout 200 python3 -m ddpkit run --nproc-per-node 1 benchmarks/bench_loop.py --device cuda \
  --model cnn --batch-size 256 --trials 7 --json "$OUT/loop-gpu.json" >"$OUT/loop-gpu.log" 2>&1
echo "rc=$?"; grep -v "^W1" "$OUT/loop-gpu.log" | tail -14
fi

if want 7; then
step "7. GPU benchmarks: checkpoint stall from GPU memory vs torch.save, DCP, Fabric, Accelerate"
timeout 240 python3 benchmarks/bench_ckpt_stall.py --device cuda --params-mb 256 --runs 3 \
  --steps 1200 --every 400 --loops 2 --dir /tmp --json "$OUT/ckpt-gpu.json" >"$OUT/ckpt-gpu.log" 2>&1
echo "rc=$?"; grep -v "^W1" "$OUT/ckpt-gpu.log" | tail -24
fi
