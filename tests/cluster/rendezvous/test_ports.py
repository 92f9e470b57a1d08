"""Job-derived ports (deterministic, wide, no aliasing), the free-port helper, and the port
search that keeps a SLURM step starting when its port is taken (real sockets, real stores)."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import ddpkit
from ddpkit.cluster.environments.slurm import slurm_rank_info
from ddpkit.cluster.rendezvous import resv_ports
from ddpkit.cluster.rendezvous.endpoint import RDZV_STEP
from ddpkit.cluster.rendezvous.ports import (
    CANDIDATE_COUNT,
    PORT_RANGE_END,
    PORT_RANGE_START,
    PortSearch,
    candidate_ports,
    free_port,
    port_for_job,
    reserved_port,
)
from ddpkit.cluster.slurmtools.runner import CommandResult, subprocess_runner
from ddpkit.errors import ConfigError, RendezvousError
from ddpkit.worker.rendezvous import portsearch
from tests.cluster.rendezvous.ports_ranks import slurm_env, slurm_worker
from tests.support.distutil import run_workers

# Where the ddpkit under test lives (src/ checkout or site-packages), for child interpreters.
SRC = Path(ddpkit.__file__).resolve().parents[1]
SPAN = PORT_RANGE_END - PORT_RANGE_START + 1


def test_range_is_wide_and_below_the_linux_ephemeral_range() -> None:
    assert PORT_RANGE_START >= 1024
    assert PORT_RANGE_END < 32768
    assert SPAN > 20000


@pytest.mark.parametrize(
    ("job_id", "step_id", "port"),
    # Pinned: a launcher and its workers may run different ddpkit versions; the mapping must
    # not drift silently.
    [("1234", None, 19009), ("1234", "0", 19782), ("1234", "1", 26869), ("5000", None, 16016)],
)
def test_port_for_job_is_pinned(job_id: str, step_id: str | None, port: int) -> None:
    assert port_for_job(job_id, step_id) == port


@pytest.mark.parametrize("job_id", ["1", "1234", "987654321", "12345_7", "abc"])
def test_port_for_job_is_in_range_and_repeatable(job_id: str) -> None:
    port = port_for_job(job_id)
    assert PORT_RANGE_START <= port <= PORT_RANGE_END
    assert port_for_job(job_id) == port
    assert port_for_job(f" {job_id} ") == port


def test_port_for_job_is_the_same_in_other_processes() -> None:
    # Python's hash() is salted per process; two interpreters with different seeds must agree.
    code = (
        "from ddpkit.cluster.rendezvous.ports import port_for_job; print(port_for_job('777', '3'))"
    )
    ports = set()
    for seed in ("1", "2", "random"):
        env = {**os.environ, "PYTHONPATH": str(SRC), "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        ports.add(int(out.stdout))
    assert ports == {port_for_job("777", "3")}


@pytest.mark.parametrize(
    "ids",
    [("1234", "11234", "21234"), ("5000", "15000"), ("42", "1042", "100042", "9999042")],
)
def test_ids_sharing_last_digits_do_not_alias(ids: tuple[str, ...]) -> None:
    ports = [port_for_job(job_id) for job_id in ids]
    assert len(set(ports)) == len(ports), dict(zip(ids, ports, strict=True))


@pytest.mark.parametrize("suffix", [1234, 5000, 42])
def test_ids_with_the_same_last_four_digits_spread_out(suffix: int) -> None:
    # 100 ids that a "last four digits" or "% 1000" scheme would map to ONE port.
    ports = {port_for_job(str(k * 10000 + suffix)) for k in range(100)}
    assert len(ports) >= 97  # birthday expectation for 100 draws from ~22768 ports: ~0.2 clashes


def test_collisions_over_consecutive_ids_follow_the_birthday_bound() -> None:
    n = 2000
    ports = [port_for_job(str(job_id)) for job_id in range(4_000_000, 4_000_000 + n)]
    clashes = n - len(set(ports))
    expected = n - SPAN * (1 - math.exp(-n / SPAN))  # ~85 for a uniform hash
    assert clashes < 1.5 * expected, (clashes, expected)
    # Every port stays in range, and the values are not bunched into one corner of it.
    assert min(ports) >= PORT_RANGE_START
    assert max(ports) <= PORT_RANGE_END
    quarters = [sum(1 for p in ports if (p - PORT_RANGE_START) * 4 // SPAN == q) for q in range(4)]
    assert all(400 <= count <= 600 for count in quarters), quarters


def test_step_id_changes_the_port() -> None:
    ports = {port_for_job("4242", str(step)) for step in range(20)} | {port_for_job("4242")}
    assert len(ports) == 21


def test_job_and_step_ids_do_not_run_together() -> None:
    assert port_for_job("12", "34") != port_for_job("123", "4")
    assert port_for_job("1234") != port_for_job("12", "34")


@pytest.mark.parametrize("job_id", ["", "   "])
def test_empty_job_id_is_rejected(job_id: str) -> None:
    with pytest.raises(ConfigError, match=r"job_id=.* is empty"):
        port_for_job(job_id)


def test_free_port_can_be_bound() -> None:
    port = free_port()
    assert 1 <= port <= 65535
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))


def test_free_port_returns_a_port_not_in_use() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        assert all(free_port() != taken for _ in range(20))


# --- candidate ports and the reserved port -------------------------------------------------


def test_candidates_start_with_the_job_port_and_are_pinned() -> None:
    ports = candidate_ports("1234", "0")
    assert ports[0] == port_for_job("1234", "0")
    # Pinned like port_for_job: every rank of a job, whatever its ddpkit, must agree.
    assert ports == (19782, 22585, 14103, 18993, 22660, 19211, 32351, 12201)


@pytest.mark.parametrize(("job_id", "step_id"), [("1234", None), ("1234", "1"), ("9", "0")])
def test_candidates_are_distinct_in_range_and_repeatable(job_id: str, step_id: str | None) -> None:
    ports = candidate_ports(job_id, step_id)
    assert len(ports) == len(set(ports)) == CANDIDATE_COUNT
    assert all(PORT_RANGE_START <= port <= PORT_RANGE_END for port in ports)
    assert candidate_ports(job_id, step_id) == ports


def test_candidates_of_other_steps_and_jobs_differ() -> None:
    assert candidate_ports("1234", "0")[1:] != candidate_ports("1234", "1")[1:]
    assert candidate_ports("1234", "0")[1:] != candidate_ports("1235", "0")[1:]


@pytest.mark.parametrize(
    ("value", "port"),
    [("12001", 12001), ("12003-12004", 12003), ("12001,12005-12006", 12001), (" 12000 ", 12000)],
)
def test_reserved_port_is_the_first_of_slurms_value(value: str, port: int) -> None:
    assert reserved_port({"SLURM_STEP_RESV_PORTS": value}) == port


def test_no_reserved_port_without_the_variable() -> None:
    assert reserved_port({}) is None
    assert reserved_port({"SLURM_STEP_RESV_PORTS": ""}) is None


@pytest.mark.parametrize("value", ["abc", "-12", "70000", "0"])
def test_bad_reserved_port_names_the_variable(value: str) -> None:
    with pytest.raises(ConfigError, match=rf"SLURM_STEP_RESV_PORTS='{value}' is not a port"):
        reserved_port({"SLURM_STEP_RESV_PORTS": value})


def test_slurm_step_searches_the_reserved_port_then_the_candidates() -> None:
    info = slurm_rank_info(slurm_env(1, 2, "77", SLURM_STEP_RESV_PORTS="12005-12006"), "slurm")
    assert info.port_search is not None
    assert info.master_port == 12005
    assert info.port_search.ports == (12005, *candidate_ports("77", "0"))
    assert info.port_search.identity == "slurm job 77 step 0 restart 0"


def test_slurm_step_without_reservation_searches_the_candidates() -> None:
    env = slurm_env(0, 2, "77", SLURM_RESTART_COUNT="2")
    info = slurm_rank_info(env, "slurm")
    assert info.port_search == PortSearch(
        "slurm job 77 step 0 restart 2", candidate_ports("77", "0")
    )
    assert info.master_port == port_for_job("77", "0")


def test_master_port_from_the_environment_is_not_searched() -> None:
    env = slurm_env(0, 2, "77", MASTER_PORT="29511", SLURM_STEP_RESV_PORTS="12005")
    info = slurm_rank_info(env, "slurm")
    assert info.port_search is None
    assert info.master_port == 29511


# --- the srun flag probe -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "flag"),
    [
        (
            "MpiDefault              = none\nMpiParams               = ports=12000-12999\n",
            "--resv-ports=1",
        ),
        ("MpiParams               = (null)\n", ""),
        ("MpiParams = ports=20000-20100,disable_slurm_hydra_bootstrap\n", "--resv-ports=1"),
        ("PrologFlags = ports=1\nMpiParams = (null)\n", ""),  # ports= elsewhere is not it
        ("", ""),
    ],
)
def test_srun_flag_only_where_slurm_has_a_port_range(
    config: str, flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    def runner(argv: Sequence[str], **kwargs: Any) -> CommandResult:
        assert list(argv) == ["scontrol", "show", "config"]
        return CommandResult(0, config, "")

    assert resv_ports.main(runner) == 0
    assert capsys.readouterr().out == flag + "\n"


@pytest.mark.parametrize("scontrol", [("false",), ("/nonexistent/scontrol",)])
def test_srun_flag_probe_never_fails_the_job(
    scontrol: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    def runner(argv: Sequence[str], **kwargs: Any) -> CommandResult:
        return subprocess_runner([*scontrol, *argv[1:]], **kwargs)

    assert resv_ports.main(runner) == 0
    assert capsys.readouterr().out == "\n"


# --- the port search, with real squatters --------------------------------------------------


@contextmanager
def _plain_listener(port: int = 0) -> Iterator[int]:
    """A socket that listens (the kernel accepts connections) but never answers."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("0.0.0.0", port))
        sock.listen()
        yield sock.getsockname()[1]


def _foreign_store(port: int = 0, identity: str | None = None) -> Any:
    """Another job's store: another ddpkit job's (with its identity) or a plain torch one."""
    store = dist.TCPStore(
        "127.0.0.1", port, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    if identity is not None:
        store.set(portsearch.IDENTITY_KEY, identity)
    return store


ID = "slurm job 1 step 0 restart 0"


def test_the_host_takes_the_first_port_it_can_bind() -> None:
    with _plain_listener() as taken, _plain_listener() as also_taken:
        free = free_port()
        search = PortSearch(ID, (taken, also_taken, free))
        store, port = portsearch.host_store("127.0.0.1", search, timedelta(seconds=30))
        assert port == free
        assert store.get(portsearch.IDENTITY_KEY) == ID.encode()


def test_a_host_with_every_candidate_taken_names_them() -> None:
    with _plain_listener() as first, _plain_listener() as second:
        search = PortSearch(ID, (first, second))
        with pytest.raises(
            RendezvousError, match=rf"every candidate port is taken \({first}, {second}\)"
        ):
            portsearch.host_store("127.0.0.1", search, timedelta(seconds=30))


def test_the_others_skip_squatters_and_find_this_jobs_store() -> None:
    with ExitStack() as stack:
        silent = stack.enter_context(_plain_listener())
        other_job = _foreign_store(identity="slurm job 2 step 0 restart 0")
        stale = _foreign_store(identity="slurm job 1 step 0 restart 7")  # an earlier run's
        plain_torch = _foreign_store()  # a store without ddpkit's identity
        ours = _foreign_store(identity=ID)
        search = PortSearch(ID, (silent, other_job.port, stale.port, plain_torch.port, ours.port))
        store, port = portsearch.find_store(
            "127.0.0.1", search, 60, timedelta(seconds=30), who="rank 1"
        )
        assert port == ours.port
        store.set("from rank 1", "hello")
        assert ours.get("from rank 1") == b"hello"


def test_the_others_give_up_naming_every_port_and_what_answered() -> None:
    with _plain_listener() as silent:
        other_job = _foreign_store(identity="slurm job 2 step 0 restart 0")
        nobody = free_port()
        search = PortSearch(ID, (silent, other_job.port, nobody))
        start = time.monotonic()
        with pytest.raises(RendezvousError) as caught:
            portsearch.find_store("127.0.0.1", search, 3, timedelta(seconds=30), who="rank 1")
        assert time.monotonic() - start < 3 + 2 * 2 + 5  # the deadline, one bounded probe, slack
    message = str(caught.value)
    assert f"rank 1 found no rendezvous store of {ID}" in message
    assert f"{silent}: a listener that is not a store (no answer" in message
    assert f"{other_job.port}: the store of slurm job 2 step 0 restart 0" in message
    assert f"{nobody}: nothing listening" in message


@pytest.mark.parametrize("delay_s", [0.0, 1.5, 4.0])
def test_a_step_whose_derived_ports_are_taken_still_starts(delay_s: float) -> None:
    # The job's own port and the next two candidates are held by things that are not its
    # store; before the port search, rank 0 failed with EADDRINUSE and the job was lost.
    job_id = str(uuid.uuid4().int % 10**9)  # SLURM's job ids are whole numbers
    ports = candidate_ports(job_id, "0")
    with ExitStack() as stack:
        stack.enter_context(_plain_listener(ports[0]))
        squatters = [
            _foreign_store(ports[1], "slurm job other step 0 restart 0"),
            _foreign_store(ports[2]),
        ]
        results = run_workers(slurm_worker, 3, job_id, delay_s, timeout_s=240)
        del squatters
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert {r["port"] for r in results} == {ports[3]}
    assert {r["sum"] for r in results} == {6.0}


# --- ddpkit run: the c10d rendezvous port ----------------------------------------------------

# Torch-free ranks: the agents' rendezvous is under test, and what a rank can show of it is the
# place the agents gave it and the workers' master port they agreed on through the rendezvous
# store (torchrun's own, not the c10d port). A group formed across two ddpkit run agents on this
# machine is tests/test_components.py's runner test's; on SLURM, the *_cluster.py tests'.
RANKS_AND_PORT = Path(__file__).resolve().parents[2] / "scripts" / "report_port_env.py"


def _agent_env(node: int, job_id: str) -> dict[str, str]:
    """``ddpkit run`` as the torchrun job script starts it: one srun task on each of 2 nodes."""
    step = {
        "SLURM_JOB_ID": job_id,
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": str(node),
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": str(node),
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        "SLURM_STEP_NODELIST": "n[1-2]",
    }
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    return {**keep, **step, "PYTHONPATH": str(SRC)}


def test_ddpkit_run_agents_meet_past_a_taken_rendezvous_port(tmp_path: Path) -> None:
    # Both agents of a 2-node rendezvous on this machine (both think they are the host, as
    # torch allows), the job's derived c10d port held by a listener that never answers. Before
    # the search, torch's agent fell back to being a client of that listener and hung.
    job_id = str(uuid.uuid4().int % 10**9)  # SLURM job ids are whole numbers
    ports = candidate_ports(job_id, RDZV_STEP)
    argv = [sys.executable, "-m", "ddpkit", "run", "--nnodes", "2", "--nproc-per-node", "1"]
    argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{ports[0]}"]
    argv += ["--rdzv-id", job_id, str(RANKS_AND_PORT)]
    with _plain_listener(ports[0]):
        agents = [
            subprocess.Popen(
                argv, env=_agent_env(node, job_id), stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True, cwd=tmp_path,
            )
            for node in range(2)
        ]  # fmt: skip
        try:
            outputs = [agent.communicate(timeout=300) for agent in agents]
        finally:
            for agent in agents:
                agent.kill()
    assert [agent.returncode for agent in agents] == [0, 0], outputs
    found = sorted(
        (json.loads(line[line.index("{") :]) for out, _ in outputs for line in out.splitlines()
         if '{"rank"' in line),
        key=lambda report: report["rank"],
    )  # fmt: skip
    assert [(report["rank"], report["world_size"]) for report in found] == [(0, 2), (1, 2)], found
    master_ports = {report["master_port"] for report in found}
    assert len(master_ports) == 1, f"the agents agreed on no one master port: {found}"
    assert ports[0] not in master_ports, f"the workers were sent to the taken port: {found}"
    moved = f"c10d rendezvous at 127.0.0.1:{ports[1]} ({ports[0]} taken)"
    assert all(moved in err for _, err in outputs), outputs
