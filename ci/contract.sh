#!/usr/bin/env bash
# ci/contract.sh: the README's first command, exactly as written, on a copy of this working tree
# in a brand-new virtualenv that holds nothing else, then the example with checkpoints in that
# same venv. The suite's own venv has the `dev` extra (numpy, pytest, ...), which once hid a
# missing runtime dependency; this step is what a new user runs, so a missing install step or
# dependency fails the test command here. Called by ci/test.sh; standalone: `bash ci/contract.sh`.
#
# Checked: the command exits 0 and prints the example's `weights sha256:` line; with
# `--checkpoint-dir` the same weights come out and checkpoint files exist (mode per the umask);
# a second run in that folder resumes from the newest checkpoint and again ends with the same
# weights (training on CPU is deterministic).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
die() { echo "ci/contract.sh: error: $*" >&2; exit 1; }

# The first line of a ```bash block in README.md that runs `ddpkit run`: the quickstart.
cmd=$(awk '/^```bash/{f=1;next} /^```/{f=0} f && /ddpkit run/ {print; exit}' README.md)
[ -n "$cmd" ] || die "README.md has no \`ddpkit run\` line in a bash block (the quickstart)"

tmp=$(mktemp -d /tmp/ddpkit-contract.XXXXXX)
[ "${DDPKIT_CONTRACT_KEEP:-0}" = 1 ] || trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/repo"
# a copy of the working tree as a clone would see it plus uncommitted edits: tracked and
# untracked-not-ignored files (no venvs, caches or build outputs)
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  git ls-files -z --cached --others --exclude-standard |
    tar --null -T - --ignore-failed-read -cf - 2>/dev/null | tar -xf - -C "$tmp/repo"
else
  cp -a . "$tmp/repo"
fi
python3 -m venv "$tmp/venv"
# nothing from the caller's environment may leak in: no PYTHONPATH, no user site
unset PYTHONPATH PYTHONHOME VIRTUAL_ENV
export PYTHONNOUSERSITE=1

run() { # run LOG COMMAND: in the copy, in the new venv; prints the log's tail on failure
  local log=$1 rc=0
  shift
  (cd "$tmp/repo" && . "$tmp/venv/bin/activate" && bash -c "$*") >"$log" 2>&1 || rc=$?
  if [ $rc != 0 ]; then
    tail -n 25 "$log" >&2
    die "exit code $rc from: $*"
  fi
}
weights() { # the hash the example prints last
  grep -oE 'weights sha256: [0-9a-f]{64}' "$1" | tail -n 1 | awk '{print $3}'
}

echo "contract: $cmd"
t0=$SECONDS
run "$tmp/first.log" "$cmd"
h1=$(weights "$tmp/first.log")
[ -n "$h1" ] || { tail -n 25 "$tmp/first.log" >&2; die "no 'weights sha256:' line from: $cmd"; }
echo "contract: exit 0 in a new venv ($((SECONDS - t0)) s), weights sha256: $h1"

ck="$tmp/ckpt"
run "$tmp/ckpt.log" "ddpkit run --nproc-per-node 2 examples/train.py --checkpoint-dir '$ck'"
h2=$(weights "$tmp/ckpt.log")
[ "$h2" = "$h1" ] || die "with --checkpoint-dir the weights are '$h2', without '$h1'"
files=$(find "$ck" -maxdepth 1 -name 'ckpt-*.pt' | wc -l)
[ "$files" -ge 1 ] || die "no checkpoint file in $ck after a run with --checkpoint-dir"
mode=$(stat -c %a "$(find "$ck" -maxdepth 1 -name 'ckpt-*.pt' | head -n 1)")
want=$(printf '%o' $((0666 & ~$(umask))))
[ "$mode" = "$want" ] || die "checkpoint file mode $mode, expected $want (0666 less umask $(umask))"
run "$tmp/resume.log" "ddpkit run --nproc-per-node 2 examples/train.py --checkpoint-dir '$ck'"
grep -q "resumed from $ck at step" "$tmp/resume.log" ||
  die "a second run in $ck did not resume from its checkpoint"
h3=$(weights "$tmp/resume.log")
[ "$h3" = "$h1" ] || die "the resumed run ends with weights '$h3', the first with '$h1'"
echo "contract: --checkpoint-dir: same weights, $files checkpoint file(s) of mode $mode;" \
  "a second run resumed and matched ($((SECONDS - t0)) s in all)"
