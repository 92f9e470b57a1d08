"""Rank-zero print and logging, and seeding: rank from the context, torch.distributed or env."""

from __future__ import annotations

import contextlib
import io
import logging
import random
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import numpy
import pytest
import torch
import torch.distributed as dist

import ddpkit
from ddpkit.errors import ConfigError
from ddpkit.worker.rankzero import get_logger, seed_everything
from tests.support.distutil import free_port, run_workers, torchrun_env


def _as_rank(monkeypatch: pytest.MonkeyPatch, rank: int, world_size: int = 4) -> None:
    """Make detect() see a torchrun worker (monkeypatch restores os.environ afterwards)."""
    for name in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in torchrun_env(rank, world_size, 29999).items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def logger_name() -> Iterator[str]:
    """A fresh logger per test, its handlers removed afterwards."""
    name = f"ddpkit.test.{uuid.uuid4().hex}"
    yield name
    logger = logging.getLogger(name)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)


@pytest.fixture
def rng_restored() -> Iterator[None]:
    states = random.getstate(), numpy.random.get_state(), torch.get_rng_state()
    yield
    random.setstate(states[0])
    numpy.random.set_state(states[1])
    torch.set_rng_state(states[2])


def test_importing_rankzero_does_not_import_torch() -> None:
    code = "import sys, ddpkit; ddpkit.print; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_print_on_rank_zero_only(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _as_rank(monkeypatch, 0)
    ddpkit.print("hello", 1, sep="-")
    assert capsys.readouterr().out == "hello-1\n"
    _as_rank(monkeypatch, 2)
    ddpkit.print("hidden")
    assert capsys.readouterr().out == ""
    ddpkit.print("shown", all_ranks=True, end="!")
    assert capsys.readouterr().out == "shown!"


def test_print_uses_the_context_once_initialized(capsys: pytest.CaptureFixture[str]) -> None:
    ddpkit.init(env={})
    try:
        ddpkit.print("from the context")
    finally:
        ddpkit.shutdown()
    assert capsys.readouterr().out == "from the context\n"


def test_logger_main_rank_info_prefixed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], logger_name: str
) -> None:
    _as_rank(monkeypatch, 0)
    log = get_logger(logger_name)
    assert get_logger(logger_name) is log and len(log.handlers) == 1  # reconfigured, not doubled
    log.info("ready %d", 7)
    log.debug("too detailed")
    logging.getLogger(f"{logger_name}.child").warning("from a child")
    err = capsys.readouterr().err
    assert f"[rank 0] INFO {logger_name}: ready 7" in err
    assert "too detailed" not in err
    assert f"[rank 0] WARNING {logger_name}.child: from a child" in err


def test_logger_silent_off_main_rank(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], logger_name: str
) -> None:
    _as_rank(monkeypatch, 3)
    monkeypatch.delenv("DDPKIT_LOG_ALL_RANKS", raising=False)
    log = get_logger(logger_name)
    log.warning("rank three speaks")
    logging.getLogger(f"{logger_name}.child").error("child speaks")
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("how", ["argument", "env"])
def test_logger_all_ranks_at_debug(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], logger_name: str, how: str
) -> None:
    _as_rank(monkeypatch, 3)
    if how == "env":
        monkeypatch.setenv("DDPKIT_LOG_ALL_RANKS", "1")
        log = get_logger(logger_name)
    else:
        monkeypatch.delenv("DDPKIT_LOG_ALL_RANKS", raising=False)
        log = get_logger(logger_name, all_ranks=True)
    log.debug("details")
    assert f"[rank 3] DEBUG {logger_name}: details" in capsys.readouterr().err
    get_logger(logger_name, all_ranks=False)  # switch back
    log.warning("quiet again")
    assert capsys.readouterr().err == ""


def test_seed_everything(monkeypatch: pytest.MonkeyPatch, rng_restored: None) -> None:
    _as_rank(monkeypatch, 0)
    assert seed_everything(42) == 42
    first = (random.random(), numpy.random.rand(), torch.rand(1).item())
    assert seed_everything(42) == 42
    assert (random.random(), numpy.random.rand(), torch.rand(1).item()) == first
    _as_rank(monkeypatch, 2)
    assert seed_everything(42) == 44
    assert (random.random(), numpy.random.rand(), torch.rand(1).item()) != first
    assert seed_everything(42, per_rank=False) == 42
    assert torch.rand(1).item() == first[2]


@pytest.mark.parametrize(
    ("seed", "match"), [(-1, "outside"), (2**32, "outside"), ("1", "not an int")]
)
def test_seed_everything_rejects(
    monkeypatch: pytest.MonkeyPatch, rng_restored: None, seed: Any, match: str
) -> None:
    _as_rank(monkeypatch, 0)
    with pytest.raises(ConfigError, match=match):
        seed_everything(seed)


def _rankzero_worker(rank: int, world_size: int, port: int, adopt_port: int) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    # A plain torch.distributed group, no ddpkit context: the rank comes from torch.
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{adopt_port}", rank=rank, world_size=world_size
    )
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ddpkit.print(f"plain group, rank {rank}")
    seen["plain_printed"] = out.getvalue()
    # torch's init returns on a rank before its peers' gloo pairs are handed over: a barrier,
    # or rank 0's destroy could close a pair under rank 1 (process_group._formed_everywhere)
    dist.barrier()
    dist.destroy_process_group()
    # With a ddpkit context.
    ddpkit.init(env=torchrun_env(rank, world_size, port))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ddpkit.print(f"context, rank {rank}")
        ddpkit.print(f"everyone, rank {rank}", all_ranks=True)
    seen["context_printed"] = out.getvalue()
    seen["seed"] = seed_everything(5)
    seen["draw"] = torch.rand(1).item()
    seen["shared_seed"] = seed_everything(5, per_rank=False)
    seen["shared_draw"] = torch.rand(1).item()
    dist.barrier()
    ddpkit.shutdown()
    return seen


@pytest.mark.multiproc
def test_rank_zero_in_a_real_group() -> None:
    first, second = run_workers(_rankzero_worker, 2, free_port())
    assert first["plain_printed"] == "plain group, rank 0\n" and second["plain_printed"] == ""
    assert first["context_printed"] == "context, rank 0\neveryone, rank 0\n"
    assert second["context_printed"] == "everyone, rank 1\n"
    assert (first["seed"], second["seed"]) == (5, 6) and first["draw"] != second["draw"]
    assert first["shared_seed"] == second["shared_seed"] == 5
    assert first["shared_draw"] == second["shared_draw"]
