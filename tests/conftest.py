"""Suite-wide guards: a test must leave no environment variable, no process group and no changed
signal disposition or signal mask behind.

The tests mirror the source tree (tests/cluster/ for ddpkit/cluster/, ...; the bottom modules
and cross-cutting checks at the top). ``tests`` is a package, so its helpers are imported as
``tests.support.*`` (golden files, spawned gloo workers, the real SLURM test cluster) and
``tests.fakes.slurm`` (the one SLURM fake), whichever folder a test sits in.
"""

from __future__ import annotations

import getpass
import json
import os
import resource
import signal
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest

# the fixtures of the SLURM tests (every file using them ends in _cluster.py: test_architecture)
from tests.support.slurm_cluster import slurm, slurm_cluster  # noqa: F401


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--times-file",
        default=None,
        help="append one JSON line per test to this file: its node id, wall seconds (setup, "
        "call and teardown) and CPU seconds, this process's and its reaped children's (ci/test.sh "
        "passes it to both its pytest runs and prints the slowest tests with ci/slowest.py)",
    )


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


_TICK = os.sysconf("SC_CLK_TCK")


def _live_children_cpu() -> float:
    """CPU seconds of this process's live children so far, with the children each of them reaped:
    a fork server (tests/support/distutil.py) lives the whole session and reaps its workers, so
    their CPU reaches RUSAGE_CHILDREN only at the end. 0 where /proc lacks the children files."""
    pids: set[str] = set()
    try:
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children", encoding="ascii") as f:
                pids.update(f.read().split())
    except OSError:
        return 0.0
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # ended and reaped meanwhile: RUSAGE_CHILDREN counts it
            continue
        total += sum(int(x) for x in fields[11:15])  # utime, stime, cutime, cstime
    return total / _TICK


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    path = item.config.getoption("--times-file")
    if not path:
        yield
        return
    wall, own = time.monotonic(), _cpu(resource.RUSAGE_SELF)
    children = _cpu(resource.RUSAGE_CHILDREN) + _live_children_cpu()
    yield
    line = {
        "test": item.nodeid,
        "wall": round(time.monotonic() - wall, 3),
        # the children's: those reaped during the test (with their own reaped children: worker
        # processes, torchrun and its workers, sbatch) and what live ones (a fork server and
        # the workers it reaped) spent meanwhile; not a SLURM job's processes (slurmd's)
        "cpu": round(_cpu(resource.RUSAGE_SELF) - own, 3),
        "cpu_children": round(_cpu(resource.RUSAGE_CHILDREN) + _live_children_cpu() - children, 3),
        "worker": os.environ.get("PYTEST_XDIST_WORKER", ""),
        "outcome": getattr(item, "_times_outcome", "?"),
    }
    # one short write with O_APPEND: lines from xdist's workers do not interleave
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """For --times-file: the test's outcome, its worst phase's (a failed teardown fails it)."""
    outcome = yield
    report = outcome.get_result()
    worst = {"?": 0, "passed": 1, "skipped": 2, "failed": 3}
    seen = getattr(item, "_times_outcome", "?")
    if worst.get(report.outcome, 0) > worst.get(seen, 0):
        item._times_outcome = report.outcome  # type: ignore[attr-defined]


# The files that take longest in ci/test.sh's SLURM run (ci/slowest.py's costliest files), longest
# first: collected first, so that its workers (`--dist loadfile --no-loadscope-reorder`: a file
# at a time, in collection order) start the long ones first and end together. xdist's own order
# (files with most tests first) left single-test files of 1-2 minutes (scale, torchx preempt,
# resize, blame) to the end, one worker busy for minutes after the others had finished. Every
# other file keeps its place after them.
# The local files that keep the cores busy (hangs, checkpoint_async_ranks, preempt_local) are
# spread out: the first four files start together, and with three of them at once beside the
# seven jobs of test_preempt_cluster, preempt_local's runs passed their 90-s bound (load ~37).
# (wall seconds of each file in `-m slurm` with 2 workers on 2026-12-02, a loaded machine; CI:
# the CI run's, for the sidecar files, which that run does not hold)
LONGEST_FIRST = (
    "tests/launch/test_preempt_cluster.py",  # 341
    "tests/jobs/test_jobs_cluster.py",  # 290
    "tests/worker/test_hangs.py",  # 219 (CI)
    "tests/cluster/rendezvous/test_ports_cluster.py",  # 189
    "tests/jobs/test_scale_cluster.py",  # 181
    "tests/worker/test_hangs_cluster.py",  # 174
    "tests/launch/test_preempt_local.py",  # 102 (CI)
    "tests/launch/test_resize_cluster.py",  # 147
    "tests/jobs/test_blame_cluster.py",  # 129
    "tests/jobs/test_torchx_preempt_cluster.py",  # 100
    "tests/worker/test_checkpoint_async_ranks.py",  # 70 (CI)
    "tests/jobs/test_nodes_cluster.py",  # 97
    "tests/jobs/test_torchx_jobs_cluster.py",  # 91
    "tests/worker/test_straggler.py",  # 71 (CI)
    "tests/launch/test_resize_launch.py",  # 67 (CI)
    "tests/jobs/test_slurm_backend_cluster.py",  # 67
    "tests/launch/test_node_order_cluster.py",  # 64
    "tests/jobs/test_sweep_cluster.py",  # 54
    "tests/launch/test_run_identity_cluster.py",  # 48
    "tests/test_components_cluster.py",  # 43
    "tests/launch/test_run_orphans.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """LONGEST_FIRST's files before the others (a stable sort: each file's tests keep their
    order, and so do the other files)."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


def pytest_configure(config: pytest.Config) -> None:
    """SIGINT as in a pytest started from a terminal, wherever this one was started: a
    non-interactive shell starts a command it puts in the background (``&``: ci/test.sh's
    SLURM run, a helper's ``nohup ... &``) with SIGINT and SIGQUIT ignored, Python then keeps
    SIGINT ignored, pytest-xdist's workers inherit that, and so does every child a test starts
    (an ignored signal survives exec): the tests of what Ctrl-C does failed only there."""
    for signum, handler in ((signal.SIGINT, signal.default_int_handler), (signal.SIGQUIT, None)):
        if signal.getsignal(signum) is signal.SIG_IGN:
            signal.signal(signum, handler or signal.SIG_DFL)


# pytest itself rewrites this one between a test's phases
_PYTEST_OWN = {"PYTEST_CURRENT_TEST"}


def _environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _PYTEST_OWN}


# torch's inductor writes this one into os.environ whenever it looks its cache folder up
# (torch/_inductor/runtime/cache_dir_utils.py: cache_dir(), at every compile, not only the first):
# set once for the whole session, to the absolute path it would write, so that a compile in any
# test, in any order, changes nothing (a per-test exception for the first import of
# torch._dynamo missed later compiles once the test order changed)
_INDUCTOR_CACHE_VAR = "TORCHINDUCTOR_CACHE_DIR"
os.environ.setdefault(
    _INDUCTOR_CACHE_VAR,
    os.path.abspath(os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")),
)


@pytest.fixture(autouse=True)
def _no_env_leak() -> Iterator[None]:
    before = _environ()
    yield
    after = _environ()
    if after != before:
        added = sorted(set(after) - set(before))
        removed = sorted(set(before) - set(after))
        changed = sorted(k for k in set(after) & set(before) if after[k] != before[k])
        for key in added:
            del os.environ[key]
        os.environ.update({k: before[k] for k in removed + changed})
        pytest.fail(
            f"test leaked environment changes: added={added} removed={removed} changed={changed}"
        )


@pytest.fixture(autouse=True)
def _no_process_group_leak() -> Iterator[None]:
    yield
    dist_mod = sys.modules.get("torch.distributed")
    if dist_mod is not None and dist_mod.is_available() and dist_mod.is_initialized():
        dist_mod.destroy_process_group()
        pytest.fail("test leaked an initialized torch.distributed process group")


# every signal a handler can be set for (SIGKILL and SIGSTOP cannot be caught), but SIGALRM:
# pytest-timeout's (its signal method), which it sets back to SIG_DFL when a test fails
# (pytest_exception_interact), before the test's fixtures end
_CATCHABLE = sorted(
    set(signal.valid_signals()) - {signal.SIGKILL, signal.SIGSTOP, signal.SIGALRM}, key=int
)


# torch's DataLoader, the first time it starts worker processes, sets a SIGCHLD handler of its
# own for the rest of the process (torch.utils.data._utils.signal_handling: once, by design; it
# chains the handler before it): not a leak of the test that happened to be first
_TORCH_ONCE = {signal.SIGCHLD: "torch.utils.data._utils.signal_handling"}


def _set_by_torch_once(signum: int, handler: object) -> bool:
    return getattr(handler, "__module__", None) == _TORCH_ONCE.get(signal.Signals(signum))


def _dispositions() -> tuple[dict[int, object], set[int]]:
    handlers = {int(signum): signal.getsignal(signum) for signum in _CATCHABLE}
    mask = {int(signum) for signum in signal.pthread_sigmask(signal.SIG_BLOCK, [])}
    return handlers, mask


def _put_back(handlers: dict[int, object], mask: set[int]) -> tuple[list[str], list[str]]:
    """Set every handler and the mask back to ``handlers`` and ``mask`` (from
    :func:`_dispositions`); the names of the signals whose handler or mask bit had moved."""
    after, after_mask = _dispositions()
    moved = [
        n for n in handlers if after[n] is not handlers[n] and not _set_by_torch_once(n, after[n])
    ]
    for signum in moved:
        if handlers[signum] is not None:  # None: not set from Python, nothing to put back
            signal.signal(signum, handlers[signum])  # type: ignore[arg-type]
    if after_mask != mask:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    blocked = sorted(signal.Signals(n).name for n in after_mask ^ mask)
    return [signal.Signals(n).name for n in moved], blocked


@pytest.fixture
def signals_put_back() -> Iterator[None]:
    """For the tests of code that owns its process's signals, run inside pytest's
    (``exclude.main`` ignores SIGTERM; torchx's own runner sets SIGINT and SIGTERM handlers):
    every handler and the mask as they were before the test."""
    handlers, mask = _dispositions()
    yield
    _put_back(handlers, mask)


@pytest.fixture(autouse=True)
def _no_signal_leak() -> Iterator[None]:
    """A test that calls code which sets a handler, ignores or blocks a signal in pytest's own
    process must put it back (or ask for ``signals_put_back``): every later test's children
    inherit an ignored signal and a blocked mask (a ``sleep`` that SIGTERM no longer ends), and
    which test that hits depends on the order the tests run in."""
    handlers, mask = _dispositions()
    yield
    changed, blocked = _put_back(handlers, mask)
    if changed or blocked:
        pytest.fail(f"test left signal dispositions changed: handlers={changed} mask={blocked}")
