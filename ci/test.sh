#!/usr/bin/env bash
# The project's test command (the README quotes it, .ci/run calls it): installs what the suite
# needs on a bare machine, proves the README's first command in a brand-new venv (ci/contract.sh),
# runs the linters and the type checker, builds the docs with `mkdocs build --strict` (a broken
# link or a stale reference fails the run), starts the real SLURM test
# cluster (ci/slurm-up: 4 nodes, accounting, installed with apt-get when missing), runs the whole
# test suite against it (the SLURM tests in pytest-xdist workers beside the others), and stops
# it again (ci/slurm-down) however pytest ends. The cluster's start, the contract and the
# linters, mypy and the docs (ci/lint.sh) run in the background from the start (the last two are
# waited for at the end and fail the run like any other step). Every run ends with the 20 slowest tests, their CPU time and the costliest files
# (ci/slowest.py), then a table of each phase's wall time. Arguments go to one plain pytest run
# instead, e.g. `bash ci/test.sh -m slurm -q`.
#
# The whole suite runs against a cluster whose nodes each have their own network namespace
# (NETNS=1; DDPKIT_SLURM_NETNS=0 turns it off): like real nodes, they share no `localhost`, so a job
# that reaches another node through localhost fails here, and
# tests/jobs/test_slurm_backend_cluster.py checks it.
# DDPKIT_SLURM_KEEP=1 leaves the cluster running afterwards (for re-running tests by hand).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# Each phase's wall time, printed as a table at the end however the run ends (phase NAME starts
# a phase and ends the one before).
run_started=$SECONDS
# the machine's busy CPU time (every process's, /proc/stat's jiffies), for the table's last line:
# on 2 cores the run is CPU-bound, so its wall time is about its CPU time over two
busy_jiffies() { awk '/^cpu /{print $2+$3+$4+$7+$8+$9; exit}' /proc/stat 2>/dev/null || echo 0; }
busy_at_start=$(busy_jiffies)
phase_names=() phase_secs=() phase_at=$SECONDS
phase() {
  if [ "${#phase_names[@]}" -gt 0 ]; then phase_secs+=($((SECONDS - phase_at))); fi
  phase_names+=("$1")
  phase_at=$SECONDS
  echo "== $1"
}
phase_table() {
  if [ "${#phase_names[@]}" -gt "${#phase_secs[@]}" ]; then phase_secs+=($((SECONDS - phase_at))); fi
  echo "== wall time by phase"
  local i
  for i in "${!phase_names[@]}"; do
    printf '  %6d s  %s\n' "${phase_secs[$i]}" "${phase_names[$i]}"
  done
  local secs=$((SECONDS - run_started)) busy hz cpus
  busy=$(busy_jiffies) hz=$(getconf CLK_TCK 2>/dev/null || echo 100) cpus=$(nproc 2>/dev/null || echo 1)
  printf '  %6d s  %s\n' "$secs" "in all"
  printf '  %6d CPU-s busy on the machine (%d cores: %d CPU-s of room)\n' \
    $(((busy - busy_at_start) / hz)) "$cpus" $((secs * cpus))
}
trap phase_table EXIT

phase "install (torch pinned by ci/constraints.txt)"
python3 -m pip install --quiet --disable-pip-version-check -c ci/constraints.txt -e ".[dev,docs]"
# This machine's environment sets PYTHONDONTWRITEBYTECODE=1. Without .pyc files each of the six
# pytest workers rewrites the asserts of every test module it collects (~8 of its ~14 CPU-s of
# collection), and each of the run's ~700 processes compiles the ddpkit modules it imports
# again; on 2 cores the run is CPU-bound, so that is wall time. The run writes them once
# instead (into __pycache__, which git ignores), and collects the tests once before the workers
# start, so that they find the rewritten modules there.
unset PYTHONDONTWRITEBYTECODE

# Work that does not wait for anything runs in the background from here, beside ruff, mypy and
# mkdocs (which use one core): the SLURM test cluster's start (ci/slurm-up) and the contract
# (ci/contract.sh, ~60-90 CPU-seconds, mostly pip unpacking torch). The pytest runs start when
# the cluster is up and the linters are done; the contract's outcome is waited for at the end
# and fails the run as before. `bg NAME LOG CMD...` starts one; the phase table lists each with
# its own wall time, marked "(background)".
bg_names=() bg_pids=() bg_logs=()
bg() {
  local name=$1 log=$2
  shift 2
  (
    started=$SECONDS
    rc=0
    "$@" || rc=$?
    echo "$((SECONDS - started))" >"$log.secs"
    exit "$rc"
  ) >"$log" 2>&1 &
  bg_names+=("$name") bg_pids+=($!) bg_logs+=("$log")
  echo "== started in the background: $name"
}
bg_wait() { # bg_wait INDEX: wait for that background job, print its log; its exit code
  local i=$1 rc=0
  wait "${bg_pids[$i]}" || rc=$?
  echo "== ${bg_names[$i]} (background, exit $rc, $(cat "${bg_logs[$i]}.secs" 2>/dev/null || echo '?') s)"
  cat "${bg_logs[$i]}"
  return "$rc"
}
bg_table() {
  local i
  for i in "${!bg_names[@]}"; do
    printf '  %6s s  %s (background)\n' "$(cat "${bg_logs[$i]}.secs" 2>/dev/null || echo '?')" \
      "${bg_names[$i]}"
  done
}
work=$(mktemp -d /tmp/ddpkit-ci-XXXXXX) # background logs and the tests' times

export DDPKIT_SLURM_DIR=${DDPKIT_SLURM_DIR:-/tmp/ddpkit-slurm}
export DDPKIT_SLURM_NETNS=${DDPKIT_SLURM_NETNS:-${NETNS:-1}}
# 8 CPUs a node (more than the real cores: the test jobs mostly wait), so that the jobs of the
# four SLURM test workers below run side by side instead of queueing behind each other
export DDPKIT_SLURM_CPUS=${DDPKIT_SLURM_CPUS:-8}
# 4 nodes: the tests of bad-node exclusion (a job needing 2 of 3 nodes) and of a 4-node job at
# scale need them; the others ask for the nodes they use (-N 1 or 2)
export DDPKIT_SLURM_NODES=${DDPKIT_SLURM_NODES:-4}
# and 2 nodes nb1, nb2 in a partition of their own (badnet: no test's job lands there unasked),
# whose host names resolve to an address the other cannot reach: gloo's interface is then
# ddpkit's choice or nothing (tests/worker/test_ifname_cluster.py). Their start adds ~0.2 s to
# the cluster's, their idle slurmd no measurable CPU
export DDPKIT_SLURM_BADNET=${DDPKIT_SLURM_BADNET:-1}
# and node nc1 in partition bind, declared with this machine's real CPUs, the cluster's task plugin
# binding what a job asks for: what each rank's CPUs are under cpu_bind, against what
# `ddpkit plan` says (tests/jobs/test_bind_cluster.py)
export DDPKIT_SLURM_BIND=${DDPKIT_SLURM_BIND:-1}
stop_cluster() {
  if [ "${DDPKIT_SLURM_KEEP:-0}" = 1 ]; then
    echo "== SLURM test cluster left running (DDPKIT_SLURM_KEEP=1): ci/slurm-down stops it"
  else
    phase "stopping the SLURM test cluster"
    bash ci/slurm-down || true
  fi
  rm -rf "${hosts_dir:-}" # the tests' hosts files (below)
}
kill_tree() { # kill_tree PID: that process and its descendants, by their ids
  local child
  for child in $(pgrep -P "$1" 2>/dev/null); do kill_tree "$child"; done
  kill -TERM "$1" 2>/dev/null || true
}
times_runs=()
finish() { # however the run ends: no background job left, the cluster down, the tables
  local pid
  for pid in "${bg_pids[@]}"; do
    if kill -0 "$pid" 2>/dev/null; then kill_tree "$pid"; fi
  done
  # the SLURM jobs' own CPU (slurmd starts their processes, so pytest's figures miss it)
  if [ "${#times_runs[@]}" -gt 0 ] && [ -f "$DDPKIT_SLURM_DIR/env.sh" ]; then
    (. "$DDPKIT_SLURM_DIR/env.sh" &&
      timeout 30 sacct -a --duplicates -n -P -o JobID,JobName,TotalCPU,WorkDir) \
      >"$work/slurm-jobs.txt" 2>/dev/null || true
  fi
  stop_cluster
  if [ "${#times_runs[@]}" -gt 0 ]; then
    python3 ci/slowest.py --files 30 --jobs "$work/slurm-jobs.txt" "${times_runs[@]}" || true
    # the times themselves, for a closer look than the table (each run replaces the last's)
    rm -rf /tmp/ddpkit-ci-times-last && mkdir -p /tmp/ddpkit-ci-times-last &&
      cp "$work"/times-*.jsonl "$work"/times.jsonl "$work"/slurm-jobs.txt /tmp/ddpkit-ci-times-last/ 2>/dev/null || true
  fi
  phase_table
  bg_table
  failure_digest "$work/others.log" "$work/slurm-tests.log"
  rm -rf "$work"
}
# The last lines of the run: each pytest run's "short test summary info" (one line a failed
# test, with the first line of its error), whose full tracebacks sit far above. A CI page that
# keeps only the start and the end of the output (stop 59's) then still names each failure's
# cause; nothing is printed when no test failed.
failure_digest() {
  local log
  for log in "$@"; do
    [ -f "$log" ] && grep -q '^FAILED \|^ERROR ' "$log" || continue
    echo "== failures in $(basename "$log" .log) (the tracebacks are above)"
    grep '^FAILED \|^ERROR ' "$log" | head -n 20 | cut -c 1-400
  done
}
trap finish EXIT
trap 'exit 130' INT # so that the EXIT trap runs on Ctrl-C and on kill too
trap 'exit 143' TERM
bg "SLURM test cluster (ci/slurm-up)" "$work/slurm-up.log" bash ci/slurm-up
slurm_up=$((${#bg_pids[@]} - 1))
bg "contract: the README's first command in a brand-new venv (ci/contract.sh)" \
  "$work/contract.log" bash ci/contract.sh
contract=$((${#bg_pids[@]} - 1))

# The linters, the type checker and the docs: one core for ~30 s, in the background beside the
# tests (they fail the run at the end like the contract; `bash ci/lint.sh` runs them alone).
bg "ruff, mypy (strict on src/), docs (mkdocs build --strict)" "$work/lint.log" bash ci/lint.sh
lint=$((${#bg_pids[@]} - 1))
# every background step's outcome, at the end: 0 when all passed
bg_outcomes() {
  local rc=0
  phase "waiting for the linters and the docs"
  bg_wait "$lint" || { echo "ci/test.sh: ci/lint.sh failed (see above)" >&2; rc=1; }
  phase "waiting for the contract (ci/contract.sh)"
  bg_wait "$contract" || { echo "ci/test.sh: ci/contract.sh failed (see above)" >&2; rc=1; }
  return "$rc"
}

phase "waiting for the SLURM test cluster"
if ! bg_wait "$slurm_up"; then
  # the SLURM tests then fail under CI=true, and are skipped saying why elsewhere
  echo "ci/test.sh: warning: ci/slurm-up failed (see above); SLURM tests cannot run" >&2
fi
export DDPKIT_TEST_SLURM_ENV=$DDPKIT_SLURM_DIR/env.sh

# torch's store client names its socket's address (a reverse lookup of ::ffff:127.0.0.1, which
# the usual hosts file does not hold) each time a process connects, and this machine's resolver
# drops some such queries: 12 of 300 clients in a row waited 5 s each (2026-11-28), so tests
# waited for nothing, by chance. The tests run where /etc/hosts is a copy holding that address
# (a name nothing looks up forward; what ddpkit doctor tells a cluster with a slow resolver to
# add), in a mount namespace of their own: the machine's file is untouched. The tests of a slow
# resolver make their own files from the machine's (DDPKIT_TEST_SYSTEM_HOSTS). Needs root and
# unshare; without them the tests run as they are.
hosts_dir=$(mktemp -d /tmp/ddpkit-test-hosts-XXXXXX)
cp /etc/hosts "$hosts_dir/system"
{ cat /etc/hosts; printf '\n::ffff:127.0.0.1 ddpkit-mapped-loopback\n'; } >"$hosts_dir/mapped"
export DDPKIT_TEST_SYSTEM_HOSTS=$hosts_dir/system
in_test_hosts() {
  if [ "$(id -u)" = 0 ] && command -v unshare >/dev/null; then
    unshare --mount --propagation private \
      sh -c 'mount --bind "$0" /etc/hosts && exec "$@"' "$hosts_dir/mapped" "$@"
  else
    "$@"
  fi
}

# Each pytest run writes every test's wall and CPU time (tests/conftest.py's --times-file); the
# EXIT trap prints the 20 slowest of both runs together (ci/slowest.py), however the run ends.
if [ "$#" -gt 0 ]; then # e.g. `bash ci/test.sh -m slurm -q`: one pytest, as asked
  phase "pytest $*"
  times_runs=("pytest=$work/times.jsonl")
  rc=0
  in_test_hosts python3 -m pytest --times-file "$work/times.jsonl" "$@" || rc=$?
  bg_outcomes || exit 1
  exit "$rc"
fi

phase "collecting the tests once (the workers then read the rewritten modules' .pyc)"
python3 -m pytest --collect-only -q -p no:cacheprovider >/dev/null 2>&1 || true # pytest reports it

# The SLURM tests spend their time waiting for the cluster (a time limit to pass, a requeued
# job's hold, KillWait), the others keep both cores busy: run the SLURM files in workers
# of their own (pytest-xdist, a file per worker at a time) beside the rest, and print their
# report after the rest's. Either failing fails the run.
# Both runs mostly wait (real processes' bounds and timeouts, the cluster's time limits and
# requeues) rather than compute: more workers overlap the waits, until the 2 cores are full
# (the SLURM jobs' own processes, ~1.7 CPU-s each for `import torch`, count there too).
# DDPKIT_CI_SLURM_WORKERS=N (default 3) workers for the SLURM run: its tests wait for the cluster
# (a time limit to pass, a requeued job's hold, KillWait), not for the cores (clean clone of
# 2026-12-02, 2 workers: 1,670 s of test wall time summed over them, 202 local CPU-s), a file at
# a time in tests/conftest.py's order, its longest files first (LONGEST_FIRST;
# --no-loadscope-reorder keeps xdist from putting the files with most tests first). The
# cluster has room: 4 nodes x 8 CPUs; the largest test job asks for 8 (test_scale_cluster).
# (3 drained two nodes once at a load of ~40, "Kill task failed": ci/slurm-up's
# UnkillableStepTimeout since; a 3-worker run at a load of 20-30 passed, 2026-12-02.)
slurm_workers=${DDPKIT_CI_SLURM_WORKERS:-3}

[[ $slurm_workers =~ ^[1-9]$ ]] ||
  { echo "ci/test.sh: DDPKIT_CI_SLURM_WORKERS=$slurm_workers: 1-9" >&2; exit 2; }
phase "pytest: the SLURM tests ($slurm_workers workers, log below) beside the others"
slurm_log=$work/slurm-tests.log
times_runs=("others=$work/times-others.jsonl" "slurm=$work/times-slurm.jsonl")
# (with them the `sidecar` tests: local processes that mostly wait for bounds and signals)
in_test_hosts python3 -m pytest -m "slurm or sidecar" -n "$slurm_workers" \
  --dist loadfile --no-loadscope-reorder \
  --times-file "$work/times-slurm.jsonl" >"$slurm_log" 2>&1 &
slurm_pid=$!
# DDPKIT_CI_WORKERS=N runs the others in N pytest-xdist workers (default 3). They too wait more
# than they compute (same run: 1,623 s of test wall time summed over 2 workers, 431 CPU-s: bounds
# and timeouts of real processes), so with 2 workers each run ended at ~875 s, one core idle
# a third of the time; a third worker overlaps more of the waits.
workers=${DDPKIT_CI_WORKERS:-3}
[[ $workers =~ ^[1-9]$ ]] || { echo "ci/test.sh: DDPKIT_CI_WORKERS=$workers: 1-9" >&2; exit 2; }
parallel=()
[ "$workers" = 1 ] || parallel=(-n "$workers" --dist worksteal)
rc=0
in_test_hosts python3 -m pytest -m "not slurm and not sidecar" "${parallel[@]}" \
  --times-file "$work/times-others.jsonl" 2>&1 | tee "$work/others.log" || rc=$?
slurm_rc=0
wait "$slurm_pid" || slurm_rc=$?
echo "== pytest -m slurm (exit $slurm_rc)"
cat "$slurm_log"
background_rc=0
bg_outcomes || background_rc=$?
if [ "$rc" != 0 ] || [ "$slurm_rc" != 0 ] || [ "$background_rc" != 0 ]; then
  echo "ci/test.sh: failed (pytest, others: exit $rc; SLURM tests: exit $slurm_rc;" \
    "linters, docs or contract: exit $background_rc)" >&2
  exit 1
fi
