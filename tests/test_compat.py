"""Each reach of ddpkit.compat into torch's and submitit's internals still holds.

When torch or submitit moves one of them, the test of that reach fails and names the installed
version: fix ddpkit/compat.py, nothing else.
"""

from __future__ import annotations

import ast
import functools
import io
import logging
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import api as mp_api
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from ddpkit import compat
from ddpkit.cluster.rendezvous.ports import free_port
from ddpkit.launch import tee

TORCH = f"torch {torch.__version__}"


def reach(test: Callable[..., None]) -> Callable[..., None]:
    """A reach that raises (the name moved, the signature changed) fails naming the versions."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        try:
            test(*args, **kwargs)
        except (ImportError, AttributeError, TypeError, KeyError) as exc:
            import submitit

            versions = f"{TORCH}, submitit {submitit.__version__}"
            pytest.fail(f"{test.__name__}: a ddpkit.compat reach broke under {versions}: {exc!r}")

    return run


def _tail_until(out: io.StringIO, done: Callable[[str], bool]) -> None:
    deadline = time.monotonic() + 30
    while not done(out.getvalue()) and time.monotonic() < deadline:
        time.sleep(0.01)


@reach
def test_tee_read_by_prints_the_rank_prefix_once(tmp_path: Path) -> None:
    from torch.distributed.elastic.multiprocessing import tail_log

    original = tail_log.tail_logfile
    log = tmp_path / "0.log"
    log.write_text("")
    out = io.StringIO()
    with compat.tee_read_by(tee.tail_whole_lines):
        assert tail_log.tail_logfile is not original, f"{TORCH}: tail_logfile was not replaced"
        tail = mp_api.TailLog("trainer", {0: str(log)}, out, {0: "[rank0]: "}).start()
        with log.open("a") as handle:
            handle.write("[rank0]: Traceback (most recent call last):\nplain line\n")
        _tail_until(out, lambda text: text.count("\n") >= 2)
        tail.stop()
    assert tail_log.tail_logfile is original  # put back afterwards
    assert out.getvalue().splitlines() == [
        "[rank0]: Traceback (most recent call last):",
        "[rank0]: plain line",
    ], f"{TORCH}: TailLog no longer calls tail_logfile with its header and destination"


@reach
def test_a_line_tailed_in_pieces_is_printed_as_one_line(tmp_path: Path) -> None:
    """A worker's line read before it ended (its text and its newline in two writes, as
    ``print`` under PYTHONUNBUFFERED=1) is held for its end, while another rank's line goes on;
    a piece never ended is printed after the hold, and at the stop."""
    logs = {rank: tmp_path / f"{rank}.log" for rank in (0, 1, 2)}
    for log in logs.values():
        log.write_text("")
    out = io.StringIO()
    with compat.tee_read_by(tee.tail_whole_lines):
        prefixes = {rank: f"[rank{rank}]: " for rank in logs}
        tail = mp_api.TailLog("trainer", {r: str(p) for r, p in logs.items()}, out, prefixes)
        tail.start()
        with logs[0].open("a") as zero, logs[1].open("a") as one, logs[2].open("a") as two:
            zero.write("loss 0.5")
            zero.flush()
            time.sleep(0.3)  # 3 polls (torch's 0.1 s) see the piece
            one.write("a whole line\n")
            one.flush()
            _tail_until(out, lambda text: "whole" in text)
            zero.write(" at step 3\n")
            zero.flush()
            _tail_until(out, lambda text: "step 3" in text)
            two.write("10%")  # never ended: printed once held for tee.HOLD_PARTIAL_LINE_S
            two.flush()
            _tail_until(out, lambda text: "10%" in text)
            assert "[rank2]: 10%" in out.getvalue(), f"a piece never ended was held: {out!r}"
            two.write(" 20%")  # the last piece: printed at the stop
        tail.stop()
    assert out.getvalue() == (
        "[rank1]: a whole line\n[rank0]: loss 0.5 at step 3\n[rank2]: 10% 20%"
    ), out.getvalue()


@reach
def test_rdzv_shared_store_made_by_replaces_where_torch_makes_the_workers_store() -> None:
    import inspect

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    handler = dynamic_rendezvous.DynamicRendezvousHandler
    original = handler._create_tcp_store_server
    params = list(inspect.signature(original).parameters)
    assert params == ["self", "master_addr", "master_port"], f"{TORCH}: {params}"
    source = inspect.getsource(handler.next_rendezvous)
    assert "self._create_tcp_store_server(" in source, f"{TORCH}: no longer made there"
    made: list[tuple[str, int]] = []
    with compat.rdzv_shared_store_made_by(lambda addr, port: made.append((addr, port)) or "s"):
        assert handler._create_tcp_store_server(object(), "127.0.0.1", 0) == "s"
    assert made == [("127.0.0.1", 0)]
    assert handler._create_tcp_store_server is original  # put back afterwards


@reach
@pytest.mark.parametrize("use_libuv", [True, False])
def test_store_ping_is_answered_by_both_of_torchs_store_servers(use_libuv: bool) -> None:
    import socket

    host = dist.TCPStore(
        "127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False,
        use_libuv=use_libuv,
    )  # fmt: skip
    for nonce in (7, 2**32 - 1, os.getpid()):
        hello, answer = compat.store_ping(nonce)
        with socket.create_connection(("127.0.0.1", host.port), timeout=10) as sock:
            sock.sendall(hello)
            got = b""
            while len(got) < len(answer) and (part := sock.recv(len(answer) - len(got))):
                got += part
        assert got == answer, f"{TORCH} (libuv={use_libuv}): TCPStore's handshake changed"
    host.set("still", "serving")  # the asks left the server as it was
    assert host.get("still") == b"serving"


@reach
def test_launch_config_from_torchrun_args(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.run as torch_run

    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # else torch writes it (several processes)

    args = torch_run.get_args_parser().parse_args(
        ["--nnodes", "1", "--nproc-per-node", "3", "--master-port", "29511", "train.py", "-x"]
    )
    config, entrypoint, cmd_args = compat.launch_config_from_args(args)
    assert (config.nproc_per_node, config.max_nodes) == (3, 1), TORCH
    assert entrypoint == sys.executable and cmd_args[-2:] == ["train.py", "-x"], TORCH


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(str(record.msg))


@reach
def test_torchrun_notice_is_muted(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.run as torch_run

    argv = ["--nproc-per-node", "2", "--standalone", "train.py"]
    logger, seen = logging.getLogger(torch_run.__name__), _Records()
    logger.addHandler(seen)  # torch's logger does not propagate: listen on it directly
    try:
        # unset, so that torch logs its notice (and writes the variable, undone by monkeypatch)
        monkeypatch.setenv("OMP_NUM_THREADS", "0")
        monkeypatch.delenv("OMP_NUM_THREADS")
        torch_run.config_from_args(torch_run.get_args_parser().parse_args(argv))
        notices = [m for m in seen.messages if "OMP_NUM_THREADS" in m]
        assert notices, f"{TORCH}: torchrun's logger no longer logs the OMP_NUM_THREADS notice"
        seen.messages.clear()
        monkeypatch.delenv("OMP_NUM_THREADS")
        with compat.torchrun_notice_muted():
            torch_run.config_from_args(torch_run.get_args_parser().parse_args(argv))
        assert not [m for m in seen.messages if "OMP_NUM_THREADS" in m], TORCH
    finally:
        logger.removeHandler(seen)


@reach
def test_recorded_traceback_from_a_real_error_file(tmp_path: Path) -> None:
    error_file = tmp_path / "error.json"
    script = (
        "from torch.distributed.elastic.multiprocessing.errors import record\n"
        "@record\n"
        "def main():\n"
        "    raise ValueError('boom in the worker')\n"
        "main()\n"
    )
    env = {"TORCHELASTIC_ERROR_FILE": str(error_file), "PATH": "/usr/bin:/bin"}
    argv = [sys.executable, "-c", script]
    done = subprocess.run(argv, env=env, capture_output=True, timeout=120, check=False)
    assert done.returncode != 0 and error_file.is_file(), done.stderr.decode()
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(error_file))
    text = compat.recorded_traceback(failure)
    assert text is not None, f"{TORCH}: @record's error file has no message/extraInfo keys"
    assert "Traceback" in text and "ValueError: boom in the worker" in text, TORCH
    absent = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(tmp_path / "none"))
    assert compat.recorded_traceback(absent) is None


@pytest.fixture
def one_rank_group() -> Iterator[dist.TCPStore]:
    """A gloo group of one on its own store (a missing key fails instead of waiting forever)."""
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True)
    store.set_timeout(timedelta(seconds=20))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield store
    finally:
        dist.destroy_process_group()


@reach
def test_default_store_is_the_groups_store(one_rank_group: dist.TCPStore) -> None:
    store = one_rank_group
    found = compat.default_store()  # torch wraps the group's store in a PrefixStore
    found.set("ddpkit/compat", "yes")
    assert found.get("ddpkit/compat") == b"yes", TORCH
    inner = found
    while hasattr(inner, "underlying_store"):
        inner = inner.underlying_store
    assert (inner.host, inner.port) == (store.host, store.port), f"{TORCH}: not our store"


@reach
@pytest.mark.usefixtures("one_rank_group")
def test_the_flight_recorder_gives_each_groups_status_and_collectives() -> None:
    status = compat.flight_recorder(False)
    assert status is not None, f"{TORCH}: _dump_fr_trace_json moved"
    assert "entries" not in status, f"{TORCH}: the status alone came with the entries"
    dist.all_reduce(torch.ones(2))
    dist.barrier()
    dump = compat.flight_recorder(True)
    assert dump is not None and dump.get("entries"), f"{TORCH}: gloo records nothing"
    last = dump["entries"][-2:]
    group = str(last[0]["pg_id"])
    numbers = dump["pg_status"][group]
    assert int(numbers["last_enqueued_collective"]) == last[1]["collective_seq_id"], dump
    assert [
        (e["profiling_name"], e["collective_seq_id"] - last[0]["collective_seq_id"]) for e in last
    ] == [
        ("gloo:all_reduce", 0),
        ("gloo:barrier", 1),
    ], f"{TORCH}: the flight recorder's entries changed: {last}"
    assert last[0]["input_sizes"] == [[2]] and last[0]["input_dtypes"] == ["Float"], last
    assert last[0]["process_group"][1] == "default_pg" and "time_created_ns" in last[0], last


def _recorder(status: dict[str, tuple[int, int]], entries: list[tuple[str, int, int]]) -> str:
    """A recorder's JSON dump as torch writes it: status by group, (group, seq, time) entries."""
    import json

    return json.dumps({
        "version": "2.10",
        "pg_status": {
            group: {"last_enqueued_collective": str(e), "last_completed_collective": str(c)}
            for group, (e, c) in status.items()
        },
        "entries": [
            {"pg_id": int(group), "collective_seq_id": seq, "time_created_ns": when,
             "profiling_name": "nccl:all_reduce" if when % 2 else "gloo:all_reduce"}
            for group, seq, when in entries
        ],
    })  # fmt: skip


def test_the_nccl_recorder_is_read_beside_the_generic_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA build keeps NCCL's collectives in a recorder of their own (an H200 showed the
    generic one empty after NCCL all_reduces); this CPU wheel has none, so torch's two dump
    functions are stood in for here: the merge is ddpkit's."""
    from torch._C import _distributed_c10d as c10d

    from ddpkit.worker.watchdog import flight

    # group 0 in both (the recorders number groups apart: not even the same group), group 1 in
    # the NCCL recorder alone. Odd times: NCCL's entries.
    generic = _recorder({"0": (4, 4)}, [("0", 3, 10), ("0", 4, 30)])
    nccl = _recorder({"0": (7, 6), "1": (2, 2)}, [("0", 6, 21), ("1", 2, 25), ("0", 7, 41)])
    monkeypatch.setattr(c10d, "_dump_fr_trace_json", lambda *a: generic, raising=False)
    monkeypatch.setattr(c10d, "_dump_nccl_trace_json", lambda *a: nccl, raising=False)
    dump = compat.flight_recorder(True)
    assert dump is not None
    assert set(dump["pg_status"]) == {"0", "nccl:0", "1"}, dump["pg_status"]
    order = [(e["pg_id"], e["collective_seq_id"]) for e in dump["entries"]]
    assert order == [(0, 3), ("nccl:0", 6), (1, 2), (0, 4), ("nccl:0", 7)], order
    status = flight._status(dump)
    in_flight = [e["collective_seq_id"] for e in dump["entries"] if flight._in_flight(e, status)]
    assert in_flight == [7], "NCCL's seq 7 (group 0: 7 enqueued, 6 completed) alone is running"

    # a recorder that fails leaves the other one's dump; none left: None
    monkeypatch.setattr(c10d, "_dump_nccl_trace_json", lambda *a: 1 / 0, raising=False)
    alone = compat.flight_recorder(True)
    assert alone is not None and set(alone["pg_status"]) == {"0"}, alone
    monkeypatch.setattr(c10d, "_dump_fr_trace_json", lambda *a: "not json", raising=False)
    assert compat.flight_recorder(True) is None


@reach
def test_submitit_renders_a_script_without_submitting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import submitit
    from submitit.slurm import slurm as submitit_slurm

    version = f"submitit {submitit.__version__}"
    # SlurmExecutor refuses to exist without srun on PATH; the renderer itself needs none
    monkeypatch.setattr(submitit_slurm.SlurmExecutor, "affinity", classmethod(lambda cls: 1))
    executor = submitit.AutoExecutor(folder=tmp_path, cluster="slurm")
    executor.update_parameters(nodes=2, tasks_per_node=3, timeout_min=5)
    text = compat.submitit_sbatch_text(executor)
    assert "#SBATCH --nodes=2" in text and "#SBATCH --ntasks-per-node=3" in text, version
    assert "submitit.core._submit" in text, version
    assert not list(tmp_path.glob("*.sh")) or "dry-run" in text  # nothing was submitted
    # map_array's array: submitit's private map_count parameter, on a copy of the executor
    array = compat.submitit_sbatch_text(executor, map_count=3).splitlines()
    assert "#SBATCH --array=0-2%3" in array, version
    assert f"#SBATCH --output={tmp_path}/%A_%a_0_log.out" in array, version
    assert "map_count" not in executor._executor.parameters  # the executor is unchanged
    assert compat.submitit_sbatch_text(executor, map_count=1) == text  # one item: a plain job


@reach
def test_submitit_sbatch_values_read_back_after_doubling_backslashes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import submitit
    from submitit.slurm import slurm as submitit_slurm

    from tests.support.sbatch_parser import directive_arguments

    version = f"submitit {submitit.__version__}"
    monkeypatch.setattr(submitit_slurm.SlurmExecutor, "affinity", classmethod(lambda cls: 1))
    values = ["a\\'\" --export=ALL,X=1 #", "trailing\\", 'it\'s "q" #1', "plain"]
    executor = submitit.AutoExecutor(folder=tmp_path, cluster="slurm")
    executor.update_parameters(
        slurm_comment=compat.submitit_sbatch_value(values[0]),
        slurm_additional_parameters={
            f"x-{i}": compat.submitit_sbatch_value(v) for i, v in enumerate(values)
        },
    )
    found = directive_arguments(compat.submitit_sbatch_text(executor))
    assert f"--comment={values[0]}" in found, f"{version}: #SBATCH quoting changed: {found}"
    assert [a for a in found if a.startswith("--x-")] == [
        f"--x-{i}={v}" for i, v in enumerate(values)
    ], f"{version}: #SBATCH quoting changed"


@reach
def test_torchx_slurm_request_exposes_each_replicas_sbatch_options(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import torchx
    from torchx import specs
    from torchx.runner import get_runner

    version = f"torchx {torchx.__version__}"
    monkeypatch.setenv("PATH", str(tmp_path))  # no sinfo: torchx's dry run then asks nothing
    role = specs.Role(name="trainer", image="", entrypoint="true", num_replicas=2)
    with get_runner() as runner:
        info = runner.dryrun(specs.AppDef("app", roles=[role]), "slurm", cfg={"time": "5"})
    groups = compat.torchx_slurm_sbatch_options(info.request, "trainer")
    assert len(groups) == 2 and all(g.get("time") == "5" for g in groups), version
    for group in groups:
        group["account"] = '"a b"'
    script = info.request.materialize()
    assert script.count('--time=5 --ntasks-per-node=1 --account="a b"') == 2, (version, script)
    assert compat.torchx_slurm_sbatch_options(info.request, "other") == []
    assert compat.torchx_slurm_sbatch_options(object(), "trainer") == []


@reach
def test_matches_machine_hostname() -> None:
    import socket

    assert compat.matches_machine_hostname(socket.gethostname()), TORCH
    assert compat.matches_machine_hostname("localhost"), TORCH
    assert not compat.matches_machine_hostname("no-such-host.invalid"), TORCH


@reach
def test_compiled_inner_finds_the_module_torch_compile_wraps() -> None:
    model = torch.nn.Linear(2, 2)
    compiled = torch.compile(model, backend="eager")  # eager: wrapping only, no code generation
    assert compat.compiled_inner(compiled) is model
    assert compat.compiled_inner(model) is None
    # state dicts carry the attribute as a key prefix: what ddpkit.clean_state_dict drops
    assert list(compiled.state_dict()) == [
        f"{compat.COMPILED_ATTRIBUTE}.weight",
        f"{compat.COMPILED_ATTRIBUTE}.bias",
    ]


@reach
@pytest.mark.usefixtures("one_rank_group")
def test_ddp_static_graph_reads_ddps_flag() -> None:
    plain = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
    static = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2), static_graph=True)
    assert not compat.ddp_static_graph(plain), f"torch {torch.__version__}"
    assert compat.ddp_static_graph(static), f"torch {torch.__version__}"
    assert not compat.ddp_static_graph(torch.nn.Linear(2, 2))


@reach
def test_foreach_mul_scales_every_tensor_in_place() -> None:
    assert hasattr(torch, "_foreach_mul_"), f"torch {torch.__version__}"
    tensors = [torch.ones(3), torch.full((2, 2), 2.0, dtype=torch.float64)]
    kept = [id(tensor) for tensor in tensors]
    compat.foreach_mul_(tensors, 0.5)
    assert [id(tensor) for tensor in tensors] == kept
    assert torch.equal(tensors[0], torch.full((3,), 0.5))
    assert torch.equal(tensors[1], torch.ones(2, 2, dtype=torch.float64))


@reach
def test_first_bucket_bytes_is_what_ddp_optimizer_checks() -> None:
    from torch._dynamo.backends.distributed import DDPOptimizer

    first = compat.first_bucket_bytes()
    assert first == 1024 * 1024, f"torch {torch.__version__}"
    DDPOptimizer(bucket_bytes_cap=first, backend_compile_fn=None)  # type: ignore[arg-type]
    with pytest.raises(AssertionError, match="First bucket"):
        DDPOptimizer(bucket_bytes_cap=first - 1, backend_compile_fn=None)  # type: ignore[arg-type]


class _Refused:
    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, ("0",))


class _OsCall:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("true",))


@reach
@pytest.mark.parametrize("kind", ["global", "builtin", "blocked", "build"])
def test_refused_globals_names_what_weights_only_refused(tmp_path: Path, kind: str) -> None:
    import numpy

    path = tmp_path / "refused.pt"
    value: Any = {
        "global": Path("x"),  # pathlib.PosixPath: an allowed module, a refused global
        "builtin": _Refused(),
        "blocked": _OsCall(),
        "build": numpy.zeros(2, dtype=numpy.uint32),
    }[kind]
    torch.save({"v": value}, path)
    allowed = (
        [] if kind != "build" else [numpy.ndarray, numpy.dtype, numpy.zeros(1).__reduce__()[0]]
    )
    with torch.serialization.safe_globals(allowed):
        with pytest.raises(Exception) as caught:
            torch.load(path, weights_only=True)
        names = compat.refused_globals(caught.value, path)
    dtype_class = type(numpy.dtype(numpy.uint32))
    expected = {
        "global": "pathlib.PosixPath",
        "builtin": "builtins.exec",
        "blocked": "posix.system",
        "build": f"{dtype_class.__module__}.{dtype_class.__name__}",
    }[kind]
    assert expected in names, (TORCH, names, str(caught.value))
    assert compat.refused_globals(RuntimeError("unexpected pos"), path) == [], TORCH


@reach
def test_refused_globals_lists_every_refused_global_of_a_path_or_an_open_file(
    tmp_path: Path,
) -> None:
    """torch's error names the first refused global; its lister adds the others, reading the
    file again: from the path, or from the start of the file the load read to its end."""
    path = tmp_path / "two.pt"
    torch.save({"a": _Refused(), "b": _OsCall()}, path)
    with path.open("rb") as file:
        with pytest.raises(Exception) as caught:
            torch.load(file, weights_only=True)
        assert file.tell() > 0
        from_file = compat.refused_globals(caught.value, file)
    assert from_file == compat.refused_globals(caught.value, path), TORCH
    assert {"builtins.exec", "posix.system"} <= set(from_file), (TORCH, from_file)


# --- no reach outside this module ---------------------------------------------------------------


def private_torch_reaches(package: Path) -> list[str]:
    """``file:line name`` of every private torch name (a dotted part starting with ``_``, e.g.
    ``torch._C._distributed_c10d.TCPStore``) imported or used outside ``compat.py``."""
    found = []
    for path in sorted(package.rglob("*.py")):
        if path == package / "compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names if alias.name.startswith("torch")]
            elif isinstance(node, ast.Attribute) and ast.unparse(node).startswith("torch."):
                names = [ast.unparse(node)]
            for name in names:
                if any(
                    part.startswith("_") and not part.startswith("__") for part in name.split(".")
                ):
                    found.append(f"{path.relative_to(package)}:{getattr(node, 'lineno', 0)} {name}")
    return found


def test_no_private_torch_name_is_reached_outside_compat() -> None:
    assert private_torch_reaches(Path(compat.__file__).parent) == []


@reach
def test_the_public_store_classes_are_torchs_own() -> None:
    """ddpkit's stores use ``torch.distributed.TCPStore``/``HashStore``/``PrefixStore`` (public,
    though not in ``__all__``) with ``master_listen_fd``, ``multi_tenant`` and ``use_libuv``;
    tests/test_store.py runs them (a store on a loopback socket, shared, closed)."""
    from torch._C import _distributed_c10d as c10d

    assert (dist.TCPStore, dist.HashStore, dist.PrefixStore) == (  # type: ignore[attr-defined]
        c10d.TCPStore,
        c10d.HashStore,
        c10d.PrefixStore,
    )
    signature = dist.TCPStore.__init__.__doc__ or ""  # type: ignore[attr-defined]
    for keyword in ("master_listen_fd", "multi_tenant", "use_libuv"):
        assert keyword in signature, signature


class _Slow(torch.nn.Module):
    """A forward that takes at least 5 ms."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.005)
        return self.layer(x)


@reach
@pytest.mark.usefixtures("one_rank_group")
def test_ddp_compute_s_reads_ddps_sampled_compute_time() -> None:
    model = torch.nn.parallel.DistributedDataParallel(_Slow())
    assert compat.ddp_compute_s(model) is None  # nothing sampled yet
    for _ in range(101):
        model(torch.randn(8, 4)).sum().backward()
    value = compat.ddp_compute_s(model)
    assert value is not None, f"{TORCH}: DDP's logging data lost its compute times"
    assert 0.005 <= value < 5.0, value
    assert compat.ddp_compute_s(torch.nn.Linear(2, 2)) is None  # not a DDP model


# An sbatch that says where it runs: its session (field 6 of /proc/PID/stat) and its parent
_SBATCH_WHERE = """#!/bin/sh
read -r line < /proc/$$/stat
set -- $line
echo "$$ $6 $PPID" > "{record}"
echo Submitted batch job 5
"""


@reach
def test_submitit_starts_sbatch_in_a_session_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import submitit

    from tests.fakes.slurm import FakeTools

    tools = FakeTools(tmp_path / "bin")
    tools.install("sbatch", _SBATCH_WHERE.format(record=tmp_path / "where"))
    tools.srun()  # SlurmExecutor refuses to exist without it
    monkeypatch.setenv("PATH", tools.path())
    executor = submitit.AutoExecutor(folder=tmp_path / "jobs", cluster="slurm")
    compat.submitit_sbatch_in_own_session(executor)
    job = executor.submit(print, "hello")
    assert job.job_id == "5", f"submitit {submitit.__version__}"
    pid, session, parent = (tmp_path / "where").read_text().split()
    # the leader of a session of its own, started by this process (the wrapper exec'd sbatch)
    assert session == pid != str(os.getsid(0)), f"submitit {submitit.__version__}"
    assert parent == str(os.getpid())


@reach
def test_dcp_metadata_names_only_the_allowed_globals(tmp_path: Path) -> None:
    """A real DCP save (one process, no group) of a model and its optimizer's state: every
    global its .metadata pickle names is in DCP_METADATA_GLOBALS (or is a torch dtype), and
    each of those resolves in this torch."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    weights, optim = get_state_dict(model, [optimizer])
    with pytest.warns(UserWarning, match="single process"):
        save({"model": weights, "optim": optim}, checkpoint_id=tmp_path)
    named: set[tuple[str, str]] = set()

    class Recording(pickle.Unpickler):  # our own file: unpickled to see what it names
        def find_class(self, module: str, name: str) -> Any:
            named.add((module, name))
            return super().find_class(module, name)

    with open(tmp_path / ".metadata", "rb") as file:
        Recording(file).load()
    dtypes = {(module, name) for module, name in named if module == "torch" and name.islower()}
    assert named - dtypes <= compat.DCP_METADATA_GLOBALS, TORCH
    assert ("torch.distributed.checkpoint.metadata", "Metadata") in named, TORCH
    for module, name in compat.DCP_METADATA_GLOBALS:
        __import__(module)
        assert hasattr(sys.modules[module], name), (module, name, TORCH)
