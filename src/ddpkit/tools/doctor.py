"""``ddpkit doctor``: every rank checks itself, rank 0 checks them together, all bounded.

The steps, each within ``timeout_s``:

1. Local, on every rank: the launcher's rank record (the runtime's own checks), the master
   address, the interface gloo (and NCCL) would use, the device choice, how fast the resolver
   names this host's address, free space in the folders, the limits that grow with the job.
2. Meeting, through a TCP store as the runtime forms it (:mod:`.meeting`), where an
   unreachable master or a taken MASTER_PORT is a FAIL naming it. Each rank writes its facts;
   rank 0 polls until all arrived or the time is up, and names the ranks that never showed up.
3. Across ranks, on rank 0: layout, versions, one GPU per rank, CUDA_VISIBLE_DEVICES. Rank 0
   publishes the verdict; every rank exits 1 when a check failed (its own, or rank 0's).
4. Unless a check failed or ``comm=False``: the all_reduce sweep (:mod:`.commtest`) on gloo,
   and on NCCL where CUDA exists, with the references.

Rank 0 prints the report; another rank prints only what it could not deliver to rank 0.
Credentials in what it prints (a MASTER_ADDR written as a URL with a password) are masked by
:mod:`ddpkit.masking`'s rule.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ddpkit.cluster.detect import detect
from ddpkit.cluster.limits import open_files, open_files_of
from ddpkit.cluster.rankinfo import ANY_PORT, RankInfo
from ddpkit.cluster.rendezvous.lookup import name_lookups_s, route_to, torch_socket_address
from ddpkit.cluster.rendezvous.ports import free_port
from ddpkit.errors import DdpkitError
from ddpkit.tools import doctor_checks as verdicts
from ddpkit.tools import netinfo
from ddpkit.tools.doctor_checks import (
    DEFAULT_TIMEOUT_S,
    Check,
    DoctorOptions,
    RankFacts,
    Report,
    from_error,
)
from ddpkit.worker.rendezvous import batched

if TYPE_CHECKING:
    from ddpkit.tools.meeting import Meeting

__all__ = ["DEFAULT_TIMEOUT_S", "DoctorOptions", "Report", "run_doctor"]

_NAME_LOOKUPS = 4  # at once on every rank, as a node's ranks connect


def run_doctor(options: DoctorOptions, env: Mapping[str, str] | None = None) -> Report:
    """Run every check for this rank (see the module docstring); never raises a DdpkitError."""
    snapshot = dict(os.environ if env is None else env)
    try:
        info = detect(snapshot)
    except DdpkitError as exc:
        return Report(0, [from_error("launcher", exc)], [], {})
    checks = _launcher_checks(info)
    if info.master_port == ANY_PORT:  # a world of one: nothing chose a port yet
        info = replace(info, master_port=free_port(info.master_addr))
    checks += _local_checks(info, snapshot, options)
    facts = _facts(info, snapshot, checks)
    from ddpkit.tools import meeting

    met = meeting.meet(info, snapshot, options.timeout_s)
    if isinstance(met, Check):
        return Report(info.rank, [*checks, met], [], {})
    with met.store_closing():
        return _together(info, met, facts, checks, options)


def _launcher_checks(info: RankInfo) -> list[Check]:
    detail = (
        f"{info.launcher}: rank {info.rank} of {info.world_size}, node {info.node_rank} "
        f"of {info.num_nodes}, master {info.master_addr}:{info.master_port or 'any'}"
    )
    if info.notes:
        noted = f"{detail}; {' '.join(info.notes)}"
        return [Check("FAIL", "launcher", noted, "run the tasks with `srun ddpkit doctor`")]
    return [Check("PASS", "launcher", detail)]


def _local_checks(info: RankInfo, env: Mapping[str, str], options: DoctorOptions) -> list[Check]:
    import torch

    found = netinfo.interfaces()
    resolved = netinfo.resolve(info.master_addr, min(5.0, options.timeout_s))
    route = route_to(resolved[0]) if resolved else None
    route_if = netinfo.interface_of(route, found) if route else None
    gloo = netinfo.gloo_choice(env, found, socket.gethostname())
    checks = [
        verdicts.check_master_address(info, resolved),
        verdicts.check_interface("gloo", gloo, info.num_nodes, route_if),
        _device_check(info, env),
    ]
    if route is not None:
        named = torch_socket_address(route)
        took = name_lookups_s(named, _NAME_LOOKUPS, min(3.0, options.timeout_s))
        checks.append(verdicts.check_name_lookup(named, _NAME_LOOKUPS, took))
    if torch.cuda.is_available():
        nccl = netinfo.nccl_choice(env, found)
        checks.append(verdicts.check_interface("nccl", nccl, info.num_nodes, route_if))
    folders = options.folders or (os.getcwd(),)
    free = {folder: _free_bytes(folder) for folder in folders}
    checks.append(verdicts.check_free_space(free, int(options.min_free_gb * 2**30)))
    return checks + _limit_checks(info, env, options)


def _limit_checks(info: RankInfo, env: Mapping[str, str], options: DoctorOptions) -> list[Check]:
    """Open files on every rank; on rank 0 (the store's host) its listen queue too. Where
    torchrun's agent hosts the store (rank 0's parent), the agent's open files instead of rank
    0's accepted connections."""
    from ddpkit.worker.rendezvous.group import uses_agent_store  # imports torch

    world = options.world_size or info.world_size
    store_rank = info.rank == 0 and world > 1
    agent = store_rank and uses_agent_store(info, env)
    checks = [verdicts.check_open_files(world, *open_files(), hosts_store=store_rank and not agent)]
    launcher = os.getppid()
    if agent and (found := open_files_of(launcher)) is not None:
        checks.append(verdicts.check_launcher_open_files(world, launcher, *found))
    if store_rank:
        checks.append(verdicts.check_listen_backlog(world, _somaxconn()))
    return checks


def _somaxconn() -> int | None:
    try:
        return int(Path("/proc/sys/net/core/somaxconn").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _free_bytes(folder: str) -> int | None:
    """Free bytes where ``folder`` is or will be (its nearest existing parent)."""
    path = Path(folder).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _device_check(info: RankInfo, env: Mapping[str, str]) -> Check:
    import torch

    from ddpkit.cluster.devices import choose_device

    cuda = torch.cuda.is_available()
    count, visible = torch.cuda.device_count() if cuda else 0, env.get("CUDA_VISIBLE_DEVICES")
    try:
        device = choose_device(info.local_rank, info.local_world_size, cuda, count, visible)
    except DdpkitError as exc:
        return from_error("device", exc)
    return Check("PASS", "device", f"rank {info.rank} would compute on {device}")


def _facts(info: RankInfo, env: Mapping[str, str], checks: Sequence[Check]) -> RankFacts:
    import torch

    from ddpkit.tools.commtest import nccl_version

    nccl = nccl_version()
    uuids: list[str] = []
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        index = info.local_rank if count >= info.local_world_size else 0
        uuids = [str(torch.cuda.get_device_properties(index).uuid)]
    node = env.get("SLURMD_NODENAME") or socket.gethostname()
    return RankFacts(
        info.rank,
        info.local_world_size,
        node,
        str(torch.__version__),
        nccl,
        env.get("CUDA_VISIBLE_DEVICES"),
        uuids,
        [asdict(c) for c in checks if c.status != "PASS"],
    )


def _together(
    info: RankInfo, met: Meeting, facts: RankFacts, checks: list[Check], options: DoctorOptions
) -> Report:
    """Steps 2-4 once the store is reached: exchange, cross-rank checks, verdict, sweep."""
    met.store.set(f"facts/{info.rank}", json.dumps(asdict(facts)))
    met.store.add("arrivals", 1)  # after the facts: rank 0 counts, then reads them all at once
    if info.rank == 0:
        checks = [*checks, met.check, *_gather_checks(info, met, options.timeout_s)]
        ok = not any(c.status == "FAIL" for c in checks)
        met.store.set("verdict", "ok" if ok else "fail")
    else:
        bound_s = 2 * options.timeout_s + 5
        verdict = met.wait_for("verdict", bound_s)
        if verdict is None:
            late = f"rank 0 gave no verdict within {bound_s:g} s"
            checks.append(Check("FAIL", "verdict", late, "see rank 0's output"))
            return Report(info.rank, checks, [], {})
        ok = verdict == "ok"
        checks = [*checks, met.check] + (
            [] if ok else [Check("FAIL", "verdict", "rank 0 found a failed check")]
        )
    report = Report(info.rank, checks, [], {})
    if ok and options.comm:
        from ddpkit.tools import commtest  # imports torch: only when the sweep runs

        commtest.run(report, info, met.store, options)
    return report


def _gather_checks(info: RankInfo, met: Meeting, timeout_s: float) -> list[Check]:
    store = met.store
    keys = [f"facts/{r}" for r in range(info.world_size)]
    # One counter polled, then a multi_get a slice of keys (batched): only a late rank costs
    # a look at each key.
    if met.count_reaches("arrivals", info.world_size, timeout_s):
        arrived = list(range(info.world_size))
    else:
        arrived = batched.present(store, keys)
    values = batched.multi_get(store, [keys[r] for r in arrived])
    facts = [RankFacts(**json.loads(value.decode())) for value in values]
    met.present = tuple(arrived)
    checks = [verdicts.check_arrivals(info.world_size, arrived, timeout_s)]
    for fact in facts[1:]:  # other ranks' own WARN/FAIL lines, named by rank
        checks += [
            Check(c["status"], f"rank {fact.rank} {c['name']}", c["detail"], c["hint"])
            for c in fact.checks
        ]
    if len(arrived) == info.world_size:
        checks += [
            verdicts.check_layout(info, facts),
            verdicts.check_versions(facts),
            verdicts.check_gpus(facts),
            verdicts.check_visible_devices(facts),
        ]
    return checks
