"""Bad nodes: blame the nodes whose health check failed, exclude them, requeue the job.

``python -m ddpkit.cluster.stop.exclude --max-excluded N --record-dir DIR`` runs in the batch
script of a spec with ``health_check:``, after each node ran the check (:mod:`.health`, whose
report lines come on stdin); each decision is logged, a line per node:

* every node answered "ok": exit 0, the job goes on;
* nodes are blamed (the check failed, timed out, or the node sent no report) and the caps allow
  it: ``scontrol requeue``, then ``scontrol update ExcNodeList=<the job's list + the blamed>``
  (SLURM changes it only while the job is pending; the requeued job cannot start while this
  process keeps it COMPLETING), exit :data:`EXIT_REQUEUED`;
* past a cap (``max_excluded_nodes``, the requeue cap, or fewer usable nodes left in the
  partition than the job needs: ``--min-nodes``, else as many as this attempt has), for a node
  the job requires (``--nodelist``), or when ``scontrol show job`` does not answer (an update
  would drop the job's own excludes): nothing is excluded, exit :data:`EXIT_FAILED`.

With ``--step-exit N`` it runs after the job's step failed with code N: a node whose check fails
now is blamed (one without a report is not: the job may be ending), and so is a node the peer
watchdog blamed (:mod:`.blamed`); the job is requeued without them, exit 0; otherwise the exit
code is N, so the job ends as it would have.

The nodes ddpkit excluded are counted in ``DIR/.ddpkit-excluded-<job>`` (kept across requeues):
the excludes a job was submitted with do not count against the cap. Each node name must be a
plain host name and reaches ``scontrol`` as one argv word, never through a shell. The plan is
pure (:func:`plan_exclusion`); every command goes through the
:class:`~ddpkit.cluster.slurmtools.Runner` seam.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ddpkit.cluster.nodelist import expand_nodelist
from ddpkit.cluster.slurmtools.commands import requeue
from ddpkit.cluster.slurmtools.query import job_fields
from ddpkit.cluster.slurmtools.runner import Runner, SlurmError, first_line, subprocess_runner
from ddpkit.cluster.stop.blamed import take_blamed
from ddpkit.cluster.stop.health import REPORT_KEY
from ddpkit.cluster.stop.requeue import RequeuePlan, max_requeues_from, plan_requeue
from ddpkit.errors import DdpkitError

__all__ = [
    "EXIT_FAILED",
    "EXIT_REQUEUED",
    "Verdict",
    "blame",
    "main",
    "plan_exclusion",
    "read_reports",
    "record_path",
]

Action = Literal["run", "requeue", "fail"]
EXIT_FAILED = 1  # the job fails: a node is bad and nothing more may be excluded
EXIT_REQUEUED = 3  # requeued without the blamed nodes: the batch shell ends (exit 0)
_NODE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
# sinfo's short node states that take no job, and the flags it appends to a state
_UNUSABLE = frozenset({"down", "drain", "drng", "fail", "failg", "maint", "inval", "unk", "npc"})
_STATE_FLAGS = "*~#!%$@^-+"
_NO_REPORT = "no health report (the check could not run there, or srun could not reach it)"


@dataclass(frozen=True)
class Verdict:
    """What the job does after its health check: ``action`` is "run", "requeue" or "fail".

    ``exclude``: the job's whole new ``ExcNodeList`` (requeue only); ``ours``: the nodes
    ddpkit will have excluded (the record); ``lines``: what to print, in order."""

    action: Action
    lines: list[str]
    exclude: list[str] = field(default_factory=list)
    ours: list[str] = field(default_factory=list)


def read_reports(text: str) -> dict[str, str | None]:
    """The health reports among ``text``'s lines: node -> None (passed) or why it failed.
    Other lines, and reports whose node is no plain name, are left out."""
    found: dict[str, str | None] = {}
    for line in text.splitlines():
        try:
            report = json.loads(line)
        except ValueError:
            continue
        if not isinstance(report, dict) or report.get(REPORT_KEY) != 1:
            continue
        node, ok, why = report.get("node"), report.get("ok"), report.get("why")
        if not isinstance(node, str) or not _NODE.fullmatch(node):
            continue
        if found.get(node) is not None:
            continue  # a failure stays: a second report (a rerun step) does not undo it
        found[node] = None if ok is True else str(why) if why else "health check failed"
    return found


def blame(
    job_nodes: Sequence[str], reports: Mapping[str, str | None], *, step_exit: int | None = None
) -> dict[str, str]:
    """The job's nodes to blame, in the job's order: those whose check failed or that sent
    no report; reports of nodes that are not the job's are ignored. ``step_exit``: the check
    ran after the job's step failed with that code; a node without a report is not blamed then
    (the job may be ending: a time limit, a cancel)."""
    when = "" if step_exit is None else f" after the job's step exited {step_exit}"
    blamed = {}
    for node in job_nodes:
        if node not in reports:
            if step_exit is None:
                blamed[node] = _NO_REPORT
        elif reports[node] is not None:
            blamed[node] = f"health check failed{when}: {reports[node]}"
    return blamed


def plan_exclusion(
    blamed: Mapping[str, str],
    *,
    job_nodes: Sequence[str],
    excluded: Sequence[str],
    ours: Sequence[str],
    max_excluded: int,
    requeue_plan: RequeuePlan,
    partition_nodes: Sequence[str] | None,
    required: Sequence[str] = (),
    min_nodes: int | None = None,
) -> Verdict:
    """The verdict (pure). ``excluded``: the job's ``ExcNodeList`` now; ``ours``: the nodes
    ddpkit excluded before; ``partition_nodes``: the usable nodes of the job's partition (None:
    not known, not checked); ``required``: its ``ReqNodeList`` (``--nodelist``); ``min_nodes``:
    the fewest nodes the job can run on (``nodes: MIN-MAX``; None: as many as it has now)."""
    # from 0, the attempt the ranks see (ctx.attempt) and `ddpkit status` shows: one number
    attempt = requeue_plan.restarts
    if not blamed:
        passed = f"health check passed on {', '.join(job_nodes)} (attempt {attempt})"
        return Verdict("run", [passed])
    lines = [f"node {node}: {why}" for node, why in blamed.items()]
    new = [node for node in blamed if node not in ours]
    after = [*ours, *new]
    names = ", ".join(blamed)
    if len(after) > max_excluded:
        done = f"; excluded so far: {', '.join(ours)}" if ours else ""
        lines.append(
            f"not excluding {names}: max_excluded_nodes={max_excluded} would be exceeded "
            f"({len(after)} nodes{done}); the job fails (raise max_excluded_nodes in the job "
            "spec, or repair the nodes)"
        )
        return Verdict("fail", lines)
    if requeue_plan.target is None:
        lines.append(f"not excluding {names}: {requeue_plan.why}; the job fails")
        return Verdict("fail", lines)
    pinned = [node for node in blamed if node in required]
    if pinned:
        lines.append(
            f"not excluding {', '.join(pinned)}: the job requires it (--nodelist "
            f"{','.join(required)}); the job fails (drop it from sbatch: nodelist)"
        )
        return Verdict("fail", lines)
    exclude = list(dict.fromkeys([*excluded, *blamed]))
    if partition_nodes is not None:
        left = [node for node in dict.fromkeys(partition_nodes) if node not in exclude]
        needed = len(job_nodes) if min_nodes is None else min_nodes
        if len(left) < needed:
            least = "" if min_nodes is None else "at least "
            lines.append(
                f"not excluding {names}: it would leave {len(left)} node(s) for a job of "
                f"{least}{needed} (excluded: {', '.join(exclude)}); the job fails"
            )
            return Verdict("fail", lines)
    noun = "node" if len(blamed) == 1 else "nodes"
    reasons = "; ".join(why if len(blamed) == 1 else f"{n}: {why}" for n, why in blamed.items())
    lines.append(
        f"excluding {noun} {names} ({reasons}); requeue attempt {attempt + 1}, "
        f"excluded: {', '.join(after)} ({len(after)} of max {max_excluded})"
    )
    return Verdict("requeue", lines, exclude, after)


def record_path(record_dir: str | os.PathLike[str], target: str) -> Path:
    """The file counting the nodes ddpkit excluded from job ``target``."""
    return Path(record_dir) / f".ddpkit-excluded-{target}"


def read_record(path: Path) -> list[str]:
    """The nodes listed in a record (first word of each line), plain names only."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return []
    words = (line.split("\t", 1)[0].strip() for line in text.splitlines())
    return list(dict.fromkeys(word for word in words if _NODE.fullmatch(word)))


def _nodes(text: str, source: str) -> list[str]:
    """A SLURM host list as names, each a plain name (else a DdpkitError naming it)."""
    if text.strip() in ("", "(null)"):
        return []
    nodes = expand_nodelist(text, source=source)
    for node in nodes:
        if not _NODE.fullmatch(node):
            raise DdpkitError(
                f"{source} names {node!r}, not a plain node name",
                hint="ddpkit excludes only nodes named with letters, digits, '.', '_', '-'",
            )
    return nodes


def _partition_nodes(partition: str, runner: Runner) -> list[str] | None:
    """The usable nodes of ``partition`` (``sinfo``: not down, drained, failed...), or None
    when sinfo does not tell."""
    if not partition or "," in partition:
        return None
    argv = ["sinfo", "--noheader", "--Node", "--partition", partition, "-o", "%N %t"]
    try:
        done = runner(argv)
    except SlurmError:
        return None
    rows = [line.split() for line in done.stdout.splitlines() if line.strip()]
    if (
        done.returncode != 0
        or not rows
        or not all(len(r) == 2 and _NODE.fullmatch(r[0]) for r in rows)
    ):
        return None
    return [name for name, state in rows if state.rstrip(_STATE_FLAGS) not in _UNUSABLE]


def exclude_and_requeue(target: str, exclude: Sequence[str], runner: Runner) -> str | None:
    """``scontrol requeue``, then ``scontrol update ExcNodeList``; None, or what failed."""
    failed = requeue(target, runner=runner)
    if failed is not None:
        return failed
    argv = ["scontrol", "update", f"JobId={target}", f"ExcNodeList={','.join(exclude)}"]
    try:
        done = runner(argv)
    except SlurmError as error:
        return f"requeued, but {shlex.join(argv)} could not run ({error.message})"
    if done.returncode != 0:
        message = first_line(done.stderr or done.stdout)
        return f"requeued, but {shlex.join(argv)} failed ({done.returncode}): {message}"
    return None


def decide(
    reports_text: str,
    env: Mapping[str, str],
    *,
    max_excluded: int,
    record_dir: str,
    runner: Runner = subprocess_runner,
    step_exit: int | None = None,
    min_nodes: int | None = None,
) -> tuple[Verdict, str | None]:
    """Read the job's state and plan: the verdict, and the target (the job id ``scontrol``
    takes) when there is one. ``step_exit``: after the job's step failed with it;
    ``min_nodes``: the fewest nodes the job runs on (None: as many as it has now)."""
    job_nodes = _nodes(env.get("SLURM_JOB_NODELIST", ""), "SLURM_JOB_NODELIST")
    blamed = blame(job_nodes, read_reports(reports_text), step_exit=step_exit)
    if step_exit is not None:  # the watchdog's: a rank whose heartbeats stopped, by its node
        for node, why in take_blamed(record_dir, env.get("SLURM_JOB_ID", "")).items():
            if node in job_nodes and node not in blamed:
                blamed[node] = f"the watchdog after the job's step exited {step_exit}: {why}"
    plan = plan_requeue(env, max_requeues_from(None, env))
    if not blamed and step_exit is not None:
        line = (
            f"the job's step exited {step_exit}; no node failed its health check after it "
            "(not a node fault): the job ends with that code"
        )
        return Verdict("fail", [line]), plan.target
    if not blamed or plan.target is None:
        verdict = plan_exclusion(
            blamed, job_nodes=job_nodes, excluded=[], ours=[], max_excluded=max_excluded,
            requeue_plan=plan, partition_nodes=None,
        )  # fmt: skip
        return verdict, plan.target
    fields = job_fields(plan.target, runner=runner)
    if fields is None:  # an update from nothing would drop the job's own excludes
        lines = [f"node {node}: {why}" for node, why in blamed.items()]
        lines.append(
            f"not excluding {', '.join(blamed)}: `scontrol show job {plan.target}` did not "
            "answer, so the job's ExcNodeList is not known; the job fails"
        )
        return Verdict("fail", lines), plan.target
    record = record_path(record_dir, plan.target)
    return plan_exclusion(
        blamed,
        job_nodes=job_nodes,
        excluded=_nodes(fields.get("ExcNodeList", ""), "the job's ExcNodeList"),
        required=_nodes(fields.get("ReqNodeList", ""), "the job's ReqNodeList"),
        ours=read_record(record),
        max_excluded=max_excluded,
        requeue_plan=plan,
        partition_nodes=_partition_nodes(env.get("SLURM_JOB_PARTITION", "").strip(), runner),
        min_nodes=min_nodes,
    ), plan.target


def run(
    reports_text: str,
    env: Mapping[str, str],
    *,
    max_excluded: int,
    record_dir: str,
    runner: Runner = subprocess_runner,
    step_exit: int | None = None,
    min_nodes: int | None = None,
) -> int:
    """Decide, act, log (stderr: the job's log); the exit code for the batch shell.

    Before the job's step: 0 (go on), :data:`EXIT_REQUEUED` or :data:`EXIT_FAILED`. After it
    failed (``step_exit``): 0 when requeued, else ``step_exit`` (the job ends as it would
    have), so that no code of the step can be taken for "requeued"."""
    verdict, target = decide(
        reports_text, env, max_excluded=max_excluded, record_dir=record_dir, runner=runner,
        step_exit=step_exit, min_nodes=min_nodes,
    )  # fmt: skip
    failed_code = EXIT_FAILED if step_exit is None else step_exit
    for line in verdict.lines[:-1]:
        _say(line)
    if verdict.action == "run":
        _say(verdict.lines[-1])
        return 0
    if verdict.action == "fail" or target is None:
        _say(verdict.lines[-1])
        return failed_code
    record = record_path(record_dir, target)
    blamed = [node for node in verdict.ours if node not in read_record(record)]
    failed = exclude_and_requeue(target, verdict.exclude, runner)
    if failed is not None and not failed.startswith("requeued"):
        _say(f"could not requeue: {failed}; the job fails")
        return failed_code
    if failed is None:
        with record.open("a", encoding="utf-8") as out:
            out.writelines(f"{node}\texcluded by ddpkit's health check\n" for node in blamed)
        _say(verdict.lines[-1])
    else:  # requeued: it runs again, maybe on the same node, which its check blames again
        _say(f"{failed}; the job was requeued without excluding {', '.join(blamed)}")
    return EXIT_REQUEUED if step_exit is None else 0


def _say(message: str) -> None:
    print(f"ddpkit: {message}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__name__}", description=__doc__)
    parser.add_argument("--max-excluded", type=int, required=True)
    parser.add_argument("--record-dir", required=True)
    parser.add_argument("--step-exit", type=int, help="after the job's step failed with it")
    parser.add_argument("--min-nodes", type=int, help="the fewest nodes the job runs on")
    args = parser.parse_args(argv)
    if args.max_excluded < 0:
        parser.error(f"--max-excluded {args.max_excluded} must be >= 0")
    if args.min_nodes is not None and args.min_nodes < 1:
        parser.error(f"--min-nodes {args.min_nodes} must be >= 1")
    if args.step_exit is not None and args.step_exit <= 0:
        parser.error(f"--step-exit {args.step_exit} must be a failed step's code (> 0)")
    # `scontrol requeue` makes SLURM TERM every process of the job: finish the update first
    # (SIGKILL still comes after KillWait)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        return run(
            sys.stdin.read(), os.environ, max_excluded=args.max_excluded,
            record_dir=args.record_dir, step_exit=args.step_exit, min_nodes=args.min_nodes,
        )  # fmt: skip
    except DdpkitError as error:
        _say(f"health check: {error}; the job fails")
        return EXIT_FAILED if args.step_exit is None else args.step_exit


if __name__ == "__main__":
    raise SystemExit(main())
