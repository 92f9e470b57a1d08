#!/usr/bin/env bash
# The GPU checks (issues 22 and 49), for a session lent a device machine (one GPU, its own python3
# with CUDA torch; pydantic, pydantic_core, annotated_types, typing_inspection and typing_extensions
# carried as cp312 wheels in .whl/, which the image lacks: see the device tool's README):
#   bash ci/gpu-check.sh                  (writes to $OUT, or /tmp/gpu-out)
#   GPU_STEPS="0 8 9" bash ci/gpu-check.sh    (only those steps)
#   bash ci/gpu-check.sh --cpu-dry        (steps 8 and 9 on CPU with gloo: where no GPU is lent)
# Every check prints one "ok" or "FAIL" line (a step that is not run: "skip"), then a summary;
# the exit code is 1 on any FAIL. Nothing here runs in CI (no GPU there).
#
# Steps, with the time each took on one H200 (2026-12-04, the whole command 225 s; the checks
# side by side, so a check's time is its group's share of 38 s):
#   0  the machine (torch, CUDA, NCCL)                                            4 s
#   1  examples/train.py on CUDA/NCCL, uninterrupted                             14 s
#   2  the same stopped by SIGTERM after its first checkpoint, resumed: bitwise  24 s
#   3  two processes on the one GPU: refused by ddpkit's device check            14 s
#   4  ddpkit doctor --quick (NCCL sweep)                                        24 s
#   5  ci/gpu_checks.py: SyncBatchNorm, bf16, async checkpoint, flight recorder  <38 s
#   8  ci/gpu_loop_checks.py: bf16, fp16+GradScaler resume, compile, FSDP2 and
#      its checkpoint loaded on CPU, accumulate                                  <38 s
#   9  ci/gpu_hang.py: the hang report of a one-rank NCCL job in a collective    <38 s
#   6  bench: the training loop (CNN), plain DDP / ddpkit / Accelerate / Fabric  86 s
#  10  bench: FSDP2 memory per rank at world 1 against DDP (the allocator's peak) 15 s
#   7  bench: checkpoint stall from GPU memory                                   81 s
# The checks (1-5, 8, 9) run side by side in five groups ("1 2", "8", "9", "5", "3 4": each its
# own processes and ports, the GPU has room for all; GPU_SERIAL=1 runs them one after another),
# then the benchmarks one after another, alone on the machine. Each step is bounded by its own
# timeout and by what is left of GPU_BUDGET_S (default 540 s), so the command ends within the
# device's 10 minutes; a step that the budget leaves out says "skip": run it in a second command
# (GPU_STEPS="6 7"). The logs come back as one archive, $OUT/logs.tgz (the device returns 8
# files at most), beside summary.txt and the benchmarks' JSON. Not here: bench_fsdp needs 2
# ranks (2 GPUs).
set -u
DRY=0
[ "${1:-}" = "--cpu-dry" ] && DRY=1
OUT=${OUT:-/tmp/gpu-out}
BUDGET=${GPU_BUDGET_S:-540}
LOG=$(mktemp -d /tmp/gpu-logs.XXXXXX)  # this run's logs alone
mkdir -p "$OUT"
: >"$OUT/summary.txt"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
if [ "$DRY" = 1 ]; then
  STEPS=" ${GPU_STEPS:-8 9} " OMP_NUM_THREADS=1
else
  STEPS=" ${GPU_STEPS:-0 1 2 3 4 5 8 9 6 10 7} "
fi
SECONDS=0
step() { echo; echo "=== $* (at ${SECONDS} s)"; }
want() { [[ "$STEPS" == *" $1 "* ]]; }
# result NAME OK [DETAIL]: one line, kept for the summary
result() {
  local line
  if [ "$2" = 0 ]; then line="ok   $1"; else line="FAIL $1"; fi
  line="$line${3:+: $3}"
  echo "$line"; echo "$line" >>"$OUT/summary.txt"
}
# the ok/FAIL lines a python check printed into LOG (under ddpkit run: "[rank0]: ok ...")
results_of() {
  local lines
  lines=$(sed -E 's/^\[rank[0-9]+\]: //' "$1" | grep -E '^(ok  |FAIL)')
  if [ -z "$lines" ]; then result "$2" 1 "printed no ok/FAIL line (see $1)"; return; fi
  echo "$lines"; echo "$lines" >>"$OUT/summary.txt"
}
# bound SECONDS: that timeout, or less when less of the budget is left
bound() { local left=$((BUDGET - SECONDS)); echo $(($1 < left ? $1 : (left > 1 ? left : 1))); }
# fits ESTIMATE NAME: whether the step's estimate fits in what is left of the budget
fits() {
  if [ $((SECONDS + $1)) -le "$BUDGET" ]; then return 0; fi
  local line="skip $2: ${SECONDS} s of GPU_BUDGET_S=$BUDGET spent (run it with GPU_STEPS)"
  echo "$line"; echo "$line" >>"$OUT/summary.txt"; return 1
}
train() { timeout -k 10 "$(bound 150)" python3 -m ddpkit run --nproc-per-node 1 examples/train.py --epochs 2 "$@"; }

s0() {
step "0. the machine"
python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(), 'nccl', torch.cuda.nccl.version())" \
  >"$LOG/machine.log" 2>&1
rc=$?; cat "$LOG/machine.log"; result "a CUDA device and NCCL" "$rc" "$(tail -1 "$LOG/machine.log")"
}

s1() { if fits 60 "1. train.py uninterrupted"; then
step "1. examples/train.py on CUDA/NCCL, one process, uninterrupted"
train >"$LOG/ref.log" 2>&1; rc=$?
grep -E "ddpkit:|eval:|sha256|Error" "$LOG/ref.log"
grep -q "sha256: [0-9a-f]" "$LOG/ref.log" || [ "$rc" != 0 ] || rc=1
result "train.py on CUDA/NCCL ends with its weights' sha256" "$rc" "rc=$rc"
fi; }

s2() { if fits 90 "2. stop/resume"; then
step "2. the same stopped by SIGTERM after its first checkpoint, then run again (resume)"
rm -rf /tmp/ck
train --checkpoint-dir /tmp/ck --checkpoint-every 20 --step-delay 0.02 >"$LOG/stop.log" 2>&1 &
run=$!
for _ in $(seq 600); do ls /tmp/ck/ckpt-*.pt >/dev/null 2>&1 && break; sleep 0.1; done
kill -TERM "$run"; wait "$run"; echo "stopped: rc=$?"
train --checkpoint-dir /tmp/ck --checkpoint-every 20 >"$LOG/resume.log" 2>&1; echo "rc=$?"
grep -E "resumed|eval:|sha256|Error" "$LOG/resume.log"
ref=$(grep -o "sha256: [0-9a-f]*" "$LOG/ref.log" 2>/dev/null); got=$(grep -o "sha256: [0-9a-f]*" "$LOG/resume.log")
[ -n "$ref" ] && [ "$ref" = "$got" ]; rc=$?
grep -q resumed "$LOG/resume.log" || rc=1
result "stop/resume: resumed, weights bitwise those of step 1" "$rc" "${ref:-no ref (step 1)} vs ${got:-none}"
fi; }

s3() { if fits 20 "3. two processes on one GPU"; then
step "3. two processes on the one GPU"
timeout -k 10 "$(bound 120)" python3 -m ddpkit run --nproc-per-node 2 examples/train.py --epochs 1 >"$LOG/two.log" 2>&1
rc=$?; grep -E "ddpkit|Error|error" "$LOG/two.log" | head -12
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "$gpus" -ge 2 ]; then result "two processes on $gpus GPUs" "$rc" "rc=$rc"
else  # one GPU: ddpkit's device check refuses before NCCL is touched (docs/verified.md)
  [ "$rc" != 0 ] && grep -q "TopologyError" "$LOG/two.log"
  result "two processes on one GPU refused with TopologyError" "$?" "rc=$rc"
fi
fi; }

s4() { if fits 30 "4. doctor"; then
step "4. ddpkit doctor (NCCL sweep)"
timeout -k 10 "$(bound 120)" python3 -m ddpkit doctor --quick >"$LOG/doctor.log" 2>&1; rc=$?
tail -25 "$LOG/doctor.log"
grep -q "FAIL" "$LOG/doctor.log" && [ "$rc" = 0 ] && rc=1
result "ddpkit doctor --quick: every check PASS" "$rc" "rc=$rc"
fi; }

s5() { if fits 40 "5. gpu_checks.py"; then
step "5. wrap: SyncBatchNorm, bf16 autocast; async checkpoint from GPU memory; watchdog + hang record on NCCL"
rm -rf /tmp/gck
timeout -k 10 "$(bound 180)" python3 -m ddpkit run --nproc-per-node 1 ci/gpu_checks.py --dir /tmp/gck >"$LOG/checks.log" 2>&1
rc=$?; results_of "$LOG/checks.log" "ci/gpu_checks.py"; result "ci/gpu_checks.py exit" "$rc" "rc=$rc"
fi; }

s8() { if fits 120 "8. gpu_loop_checks.py"; then
step "8. the loop's features: bf16, fp16 + GradScaler resume, compile, FSDP2 + checkpoint on CPU, accumulate"
rm -rf /tmp/glc; mkdir -p /tmp/glc
dry=(); [ "$DRY" = 1 ] && dry=(--cpu-dry)
timeout -k 10 "$(bound 300)" python3 -m ddpkit run --nproc-per-node 1 ci/gpu_loop_checks.py --dir /tmp/glc "${dry[@]}" \
  >"$LOG/loop-checks.log" 2>&1
rc=$?; results_of "$LOG/loop-checks.log" "ci/gpu_loop_checks.py"; result "ci/gpu_loop_checks.py exit" "$rc" "rc=$rc"
fi; }

s9() { if fits 45 "9. hang report"; then
step "9. the hang report of a job stuck in an NCCL collective (with --cpu-dry: gloo, 2 ranks)"
if [ "$DRY" = 1 ]; then hang=(--nproc-per-node 2 ci/gpu_hang.py --cpu-dry --hold 12)
else hang=(--nproc-per-node 1 ci/gpu_hang.py --hold 15); fi
timeout -k 10 "$(bound 150)" python3 -m ddpkit run "${hang[@]}" >"$LOG/hang.log" 2>&1; rc=$?
grep -v "^W1" "$LOG/hang.log" | grep -E "in flight|ddpkit: hang|rank 0 \(|completed|Error" | cut -c1-400
result "the job stuck in the collective went on and ended" "$rc" "rc=$rc"
# the flight recorder's entry as the report gives it: op, sequence number, sizes, dtype, group
grep -qE "ddpkit: hang:.* all_reduce #[0-9]+ \[4\] float32 on default_pg" "$LOG/hang.log"
result "hang report: headline names the all_reduce in flight" "$?"
grep -qE "rank 0 \(host .*\) is in all_reduce #[0-9]+ \[4\] float32 on default_pg at ci/gpu_hang.py:[0-9]+" "$LOG/hang.log"
result "hang report: rank 0 in the all_reduce, at its line of ci/gpu_hang.py" "$?"
if [ "$DRY" = 0 ]; then  # torch's NCCL recorder itself, read while the collective was held
  grep -qE "in flight: profiling_name='nccl:all_reduce' .*state='(scheduled|started)'" "$LOG/hang.log"
  result "flight recorder: nccl:all_reduce entry not completed while held" "$?"
fi
fi; }

s6() { if fits 120 "6. bench_loop"; then
step "6. GPU benchmarks: the training loop (ResNet-style CNN), plain DDP / ddpkit / Accelerate / Fabric"
timeout -k 10 "$(bound 200)" python3 -m ddpkit run --nproc-per-node 1 benchmarks/bench_loop.py --device cuda \
  --model cnn --batch-size 256 --trials 7 --json "$OUT/loop-gpu.json" >"$LOG/loop-gpu.log" 2>&1
rc=$?; grep -v "^W1" "$LOG/loop-gpu.log" | tail -14
result "bench_loop --device cuda (figures in $OUT/loop-gpu.json)" "$rc" "rc=$rc$([ "$rc" = 124 ] && echo " (timed out)")"
fi; }

s7() { if fits 120 "7. bench_ckpt_stall"; then
step "7. GPU benchmarks: checkpoint stall from GPU memory vs torch.save, DCP, Fabric, Accelerate"
timeout -k 10 "$(bound 240)" python3 benchmarks/bench_ckpt_stall.py --device cuda --params-mb 256 --runs 3 \
  --steps 1200 --every 400 --loops 2 --dir /tmp --json "$OUT/ckpt-gpu.json" >"$LOG/ckpt-gpu.log" 2>&1
rc=$?; grep -v "^W1" "$LOG/ckpt-gpu.log" | tail -24
result "bench_ckpt_stall --device cuda (figures in $OUT/ckpt-gpu.json)" "$rc" "rc=$rc$([ "$rc" = 124 ] && echo " (timed out)")"
fi; }

s10() { if fits 40 "10. bench_fsdp_memory"; then
step "10. GPU benchmarks: FSDP2 memory per rank at world 1 against DDP, counted and the allocator's peak"
timeout -k 10 "$(bound 150)" python3 benchmarks/bench_fsdp_memory.py --device cuda --worlds 1 --width 4096 \
  --blocks 8 --json "$OUT/fsdp-memory-gpu.json" >"$LOG/fsdp-memory-gpu.log" 2>&1
rc=$?; grep -v "^W1" "$LOG/fsdp-memory-gpu.log" | tail -8
result "bench_fsdp_memory --device cuda (figures in $OUT/fsdp-memory-gpu.json)" "$rc" "rc=$rc$([ "$rc" = 124 ] && echo " (timed out)")"
fi; }

# run_steps N...: those of the steps asked for (GPU_STEPS), in that order
run_steps() { local n; for n in "$@"; do if want "$n"; then "s$n"; fi; done; }
run_steps 0
if [ "${GPU_SERIAL:-$DRY}" = 1 ]; then  # default: side by side on a GPU, serial in --cpu-dry
  run_steps 1 2 3 4 5 8 9
else  # side by side: each group's output kept apart, printed when all have ended
  i=0
  for group in "1 2" "8" "9" "5" "3 4"; do
    # shellcheck disable=SC2086  # a group is a list of step numbers
    run_steps $group >"$LOG/group-$i.txt" 2>&1 &
    i=$((i + 1))
  done
  wait
  cat "$LOG"/group-*.txt
fi
run_steps 6 10 7
tar czf "$OUT/logs.tgz" -C "$(dirname "$LOG")" "$(basename "$LOG")" 2>/dev/null

echo
echo "=== summary (${SECONDS} s)"
cat "$OUT/summary.txt"
oks=$(grep -c "^ok" "$OUT/summary.txt"); fails=$(grep -c "^FAIL" "$OUT/summary.txt")
skips=$(grep -c "^skip" "$OUT/summary.txt")
echo "$oks ok, $fails FAIL, $skips skipped"
[ "$fails" = 0 ]
