"""The doctor's checks: pure functions over facts, each returning one :class:`Check`, and
what a run is asked (:class:`DoctorOptions`) and produces (:class:`Report`), shared by the
doctor and its communication step (:mod:`.commtest`) so neither imports the other.

A check never does I/O: :mod:`ddpkit.tools.doctor` gathers the facts (per rank, then across
ranks through the store) and hands them here, so every verdict is table-tested without a
cluster. Where the runtime already has the rule (device choice, one GPU per rank), the check
calls the runtime's own function and turns its ``TopologyError`` into a FAIL line.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from ddpkit.cluster.devices import check_distinct_gpus, parse_visible_devices
from ddpkit.cluster.limits import (
    ASK_ADMINS,
    SPARE_FILES,
    STORE_CONNECTIONS_PER_RANK,
    launcher_shortfall,
    open_files_needed,
)
from ddpkit.cluster.rankinfo import RankInfo
from ddpkit.cluster.rendezvous.lookup import SLOW_LOOKUP_S
from ddpkit.errors import DdpkitError
from ddpkit.masking import mask_text, mask_tree
from ddpkit.tools.netinfo import Choice, is_loopback

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "Check",
    "DoctorOptions",
    "RankFacts",
    "Report",
    "check_arrivals",
    "check_free_space",
    "check_gpus",
    "check_interface",
    "check_launcher_open_files",
    "check_layout",
    "check_listen_backlog",
    "check_master_address",
    "check_name_lookup",
    "check_open_files",
    "check_versions",
    "check_visible_devices",
    "from_error",
]

Status = Literal["PASS", "WARN", "FAIL"]


@dataclass(frozen=True)
class Check:
    """One verdict: ``PASS|WARN|FAIL <name>: <detail> (hint: ...)`` (no hint on PASS)."""

    status: Status
    name: str
    detail: str
    hint: str | None = None

    def line(self) -> str:
        hint = f" (hint: {self.hint})" if self.hint and self.status != "PASS" else ""
        return f"{self.status} {self.name}: {self.detail}{hint}"


@dataclass(frozen=True)
class RankFacts:
    """What one rank tells rank 0 (JSON through the store)."""

    rank: int
    local_world_size: int
    node: str  # SLURMD_NODENAME when set (nodes may share a host name), else the host name
    torch: str
    nccl: str | None
    cuda_visible_devices: str | None
    gpu_uuids: list[str] = field(default_factory=list)
    checks: list[dict[str, Any]] = field(default_factory=list)  # its own checks, as dicts


DEFAULT_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class DoctorOptions:
    """What ``ddpkit doctor``'s flags ask for."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    quick: bool = False
    comm: bool = True
    folders: tuple[str, ...] = ()
    min_free_gb: float = 1.0
    world_size: int | None = None  # size the limits for this many ranks (default: the job's)


@dataclass
class Report:
    """The checks (one line each), the sweep rows and the references (rank 0's view)."""

    rank: int
    checks: list[Check]
    allreduce: list[dict[str, Any]]
    references: dict[str, float | None]

    @property
    def failed(self) -> bool:
        return any(c.status == "FAIL" for c in self.checks)

    def text(self, *, problems_only: bool = False) -> str:
        """The check lines (only WARN/FAIL with ``problems_only``), then the sweep's table."""
        lines = [
            mask_text(c.line()) for c in self.checks if c.status != "PASS" or not problems_only
        ]
        if self.allreduce:
            lines.append(
                f"{'backend':>8} {'size (B)':>10} {'time (us)':>11} "
                f"{'algbw (GB/s)':>13} {'busbw (GB/s)':>13}"
            )
            lines += [
                f"{r['backend']:>8} {r['size_bytes']:>10} {r['time_us']:>11.1f} "
                f"{r['algbw_gbps']:>13.3f} {r['busbw_gbps']:>13.3f}"
                for r in self.allreduce
            ]
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(
            {
                "rank": self.rank,
                "ok": not self.failed,
                "checks": [mask_tree(asdict(c)) for c in self.checks],
                "allreduce": self.allreduce,
                "references": self.references,
            }
        )


def from_error(name: str, error: DdpkitError) -> Check:
    """A FAIL line from one of ddpkit's errors, its message and hint kept apart."""
    return Check("FAIL", name, " ".join(error.message.split()), error.hint)


def check_master_address(info: RankInfo, resolved: Sequence[str]) -> Check:
    """MASTER_ADDR resolves, and is not loopback when the job spans several nodes."""
    addr = info.master_addr
    if not resolved:
        hint = "check the spelling, or use rank 0's IP address"
        return Check("FAIL", "master address", f"MASTER_ADDR={addr} does not resolve", hint)
    if info.num_nodes > 1 and (is_loopback(addr) or all(is_loopback(a) for a in resolved)):
        return Check(
            "FAIL",
            "master address",
            f"the job spans {info.num_nodes} nodes but MASTER_ADDR={addr} is loopback "
            f"({', '.join(resolved)}): ranks on other nodes would wait for their own host",
            "set MASTER_ADDR to rank 0's host name (the first host of SLURM_JOB_NODELIST), "
            "or unset it under srun and let ddpkit take the first node",
        )
    return Check("PASS", "master address", f"MASTER_ADDR={addr} resolves to {', '.join(resolved)}")


def check_interface(backend: str, choice: Choice, num_nodes: int, route: str | None) -> Check:
    """The interface ``backend`` would use exists, and is not loopback on several nodes; on
    several nodes, one its own rules picked (the host name's address for gloo) that is not the
    interface of the route to MASTER_ADDR is a WARN: the host name may resolve to an address
    the other nodes cannot reach (pytorch#111424), and the fix names the route's interface."""
    name = f"{backend} interface"
    variable = f"{backend.upper()}_SOCKET_IFNAME"
    suggest = (
        f"export {variable}={route} (the interface of the route to MASTER_ADDR)"
        if route and route != choice.interface
        else f"export {variable}=<the interface of the cluster network>"
    )
    if choice.interface is None or choice.address is None:
        return Check("FAIL", name, choice.reason, suggest)
    where = f"{choice.interface} ({choice.address}), because {choice.reason}"
    if choice.loopback and num_nodes > 1:
        return Check("FAIL", name, f"{where}: loopback on a {num_nodes}-node job", suggest)
    chosen_by_user = choice.reason.startswith(variable)  # the user's pick stays theirs
    if num_nodes > 1 and route and route != choice.interface and not chosen_by_user:
        elsewhere = f"{where}, but the route to MASTER_ADDR leaves through {route}"
        unreached = f"{elsewhere}: other nodes may not reach {choice.address}"
        return Check("WARN", name, unreached, suggest)
    return Check("PASS", name, where)


def check_arrivals(world_size: int, arrived: Sequence[int], waited_s: float) -> Check:
    """Every rank reported to rank 0; names the ones that never showed up."""
    missing = sorted(set(range(world_size)) - set(arrived))
    if missing:
        shown = ", ".join(str(r) for r in missing[:20]) + (" ..." if len(missing) > 20 else "")
        return Check(
            "FAIL",
            "ranks",
            f"{len(missing)} of {world_size} ranks never showed up within {waited_s:g} s: {shown}",
            "did those ranks start (check their logs and the launcher's task count)? a rank "
            "that cannot reach the master prints its own FAIL line",
        )
    return Check("PASS", "ranks", f"all {world_size} ranks reported")


def check_layout(info: RankInfo, facts: Sequence[RankFacts]) -> Check:
    """The nodes hosting ranks match the node count, and each node's ranks its local size."""
    per_node: dict[str, list[RankFacts]] = {}
    for fact in facts:
        per_node.setdefault(fact.node, []).append(fact)
    counts = ", ".join(f"{node}: {len(ranks)}" for node, ranks in per_node.items())
    hint = (
        "tasks x processes must equal the world size: one torchrun per node, or one srun "
        "task per process, never both"
    )
    if len(per_node) != info.num_nodes:
        nodes = len(per_node)
        wrong = f"{nodes} nodes host ranks ({counts}) but the launcher says {info.num_nodes}"
        return Check("FAIL", "layout", wrong, hint)
    for node, ranks in per_node.items():
        if len(ranks) != ranks[0].local_world_size:
            wrong = f"{len(ranks)} ranks on {node} but LOCAL_WORLD_SIZE={ranks[0].local_world_size}"
            return Check("FAIL", "layout", wrong, hint)
    where = f"{info.num_nodes} node(s) ({counts}), launcher {info.launcher}"
    return Check("PASS", "layout", f"{info.world_size} ranks on {where}")


def check_versions(facts: Sequence[RankFacts]) -> Check:
    """torch (and NCCL, where present) are the same version on every rank."""
    for what, values in (("torch", [f.torch for f in facts]), ("NCCL", [f.nccl for f in facts])):
        seen: dict[str | None, list[int]] = {}
        for fact, value in zip(facts, values, strict=True):
            seen.setdefault(value, []).append(fact.rank)
        if len(seen) > 1:
            shown = "; ".join(f"{v}: ranks {_ranks(r)}" for v, r in seen.items())
            hint = "use one environment (venv / module) on every node"
            return Check("FAIL", "versions", f"{what} differs between ranks ({shown})", hint)
    nccl = facts[0].nccl if facts else None
    torch = facts[0].torch if facts else "?"
    return Check(
        "PASS", "versions", f"torch {torch}" + (f", NCCL {nccl}" if nccl else "") + " on every rank"
    )


def _ranks(ranks: Sequence[int]) -> str:
    return ",".join(str(r) for r in ranks[:8]) + ("..." if len(ranks) > 8 else "")


def check_gpus(facts: Sequence[RankFacts]) -> Check:
    """No two ranks on one physical GPU (the runtime's own check, by GPU uuid and node)."""
    if not any(f.gpu_uuids for f in facts):
        return Check("PASS", "gpus", "no GPUs in use (CPU ranks)")
    try:
        check_distinct_gpus([(f.node, f.gpu_uuids) for f in facts])
    except DdpkitError as exc:
        return from_error("gpus", exc)
    return Check("PASS", "gpus", f"{sum(len(f.gpu_uuids) for f in facts)} GPUs, one per rank")


def check_visible_devices(facts: Sequence[RankFacts]) -> Check:
    """On each node, CUDA_VISIBLE_DEVICES is the same for all ranks or disjoint between them."""
    per_node: dict[str, list[RankFacts]] = {}
    for fact in facts:
        per_node.setdefault(fact.node, []).append(fact)
    for node, ranks in per_node.items():
        lists = [tuple(parse_visible_devices(f.cuda_visible_devices) or ()) for f in ranks]
        if len(set(lists)) <= 1:
            continue
        owned: dict[str, int] = {}
        for fact, devices in zip(ranks, lists, strict=True):
            for device in devices:
                if device in owned:
                    return Check(
                        "WARN",
                        "CUDA_VISIBLE_DEVICES",
                        f"on {node} ranks {owned[device]} and {fact.rank} both see GPU {device} "
                        "but their lists differ",
                        "give every task the same list, or disjoint lists (--gpus-per-task)",
                    )
                owned[device] = fact.rank
    values = sorted({f.cuda_visible_devices or "unset" for f in facts})
    return Check("PASS", "CUDA_VISIBLE_DEVICES", "consistent: " + " | ".join(values[:8]))


def check_free_space(folders: Mapping[str, int | None], min_free_bytes: int) -> Check:
    """Every folder (log, checkpoint) has at least ``min_free_bytes`` free (None: unknown)."""
    shown = []
    for folder, free in folders.items():
        if free is None:
            hint = "create it, or pass the folder your job writes to with --dir"
            return Check("WARN", "free space", f"{folder}: cannot be examined", hint)
        shown.append(f"{folder} {free / 2**30:.1f} GiB")
        if free < min_free_bytes:
            low = f"{folder} has {free / 2**30:.2f} GiB free, under {min_free_bytes / 2**30:g} GiB"
            hint = "free space, or write logs and checkpoints elsewhere"
            return Check("FAIL", "free space", low, hint)
    return Check("PASS", "free space", ", ".join(shown))


# --- limits that must grow with the job --------------------------------------------------------


def check_open_files(world_size: int, soft: int, hard: int, *, hosts_store: bool) -> Check:
    """The open-files limit (``ulimit -n``: ``soft``; ``hard`` its ceiling) fits the job."""
    need = open_files_needed(world_size, hosts_store)
    rule = (
        f"{world_size} ranks: {STORE_CONNECTIONS_PER_RANK} store connections each"
        f"{' accepted here' if hosts_store else ''}, a socket per peer, {SPARE_FILES} spare"
    )
    if soft >= need:
        return Check("PASS", "open files", f"ulimit -n {soft} >= {need} ({rule})")
    if hard >= need:  # ddpkit.init raises the soft limit itself (ddpkit.cluster.limits)
        return Check(
            "PASS",
            "open files",
            f"ulimit -n {soft} < {need} ({rule}): ddpkit.init raises it, the hard limit {hard} "
            f"allows it (a program that does not call ddpkit.init: `ulimit -n {need}` first)",
        )
    fix = f"the hard limit is {hard}: {ASK_ADMINS}"
    return Check("WARN", "open files", f"ulimit -n {soft} < {need} ({rule})", fix)


def check_launcher_open_files(world_size: int, pid: int, soft: int, hard: int) -> Check:
    """The open-files limit of the launcher whose agent hosts the store (torchrun's default):
    one accepted connection per store connection of every rank, which ddpkit cannot raise."""
    short = launcher_shortfall(world_size, pid, soft, hard)
    if short is not None:
        return Check("WARN", "launcher open files", *short)
    need = open_files_needed(world_size, hosts_store=True)
    what = f"the launcher (pid {pid}) hosts the job's store"
    return Check("PASS", "launcher open files", f"{what}: ulimit -n {soft} >= {need}")


def check_listen_backlog(world_size: int, somaxconn: int | None) -> Check:
    """``net.core.somaxconn`` caps the store's listen queue (torch asks for the largest one):
    below the world size, the connects of a job's start overflow it and the dropped ones are
    retried only after the kernel's SYN back-off (1 s, 3 s, 7 s ...)."""
    if somaxconn is None:
        unknown = "net.core.somaxconn cannot be read: the store's listen queue is unknown"
        hint = "check /proc/sys/net/core/somaxconn on the node of rank 0"
        return Check("WARN", "listen backlog", unknown, hint)
    if somaxconn >= world_size:
        return Check(
            "PASS", "listen backlog", f"net.core.somaxconn {somaxconn} >= {world_size} ranks"
        )
    return Check(
        "WARN",
        "listen backlog",
        f"net.core.somaxconn {somaxconn} < {world_size} ranks: ranks connecting to the store "
        "at once overflow its listen queue and wait for the kernel's retries",
        f"on the node of rank 0: sysctl -w net.core.somaxconn={max(4096, world_size)} (root)",
    )


def check_name_lookup(address: str, count: int, took_s: float) -> Check:
    """torch's store client names its socket's address (a reverse lookup) on a process's first
    connect: where DNS does not answer (air-gapped, a container's resolver) every rank waits
    for its timeout, and torch only warns "The hostname of the client socket cannot be
    retrieved"."""
    what = f"{count} reverse lookups of {address} at once (torch's store client makes one)"
    if took_s < SLOW_LOOKUP_S:
        return Check("PASS", "name lookup", f"{what}: answered in {1e3 * took_s:.0f} ms")
    waited = "not all answered" if took_s == float("inf") else f"answered in {took_s:.1f} s"
    return Check(
        "WARN",
        "name lookup",
        f"{what}: {waited}: every rank's first store connect waits for the resolver",
        f"add a line '{address} <this host's name>' to /etc/hosts on every node, or have DNS "
        f"answer reverse lookups for it at once",
    )
