"""ddpkit.progress: drawn on the main rank's terminal only, silent otherwise, resume-aware."""

from __future__ import annotations

import io
import os
import pty
import threading
from collections.abc import Iterator
from typing import Any

import pytest

import ddpkit
from ddpkit.errors import ConfigError
from ddpkit.worker.progress import Progress, render, wanted
from tests.support.distutil import Indices, run_workers, torchrun_env


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("enabled", "tty", "rank", "environ", "drawn"),
    [
        (None, True, 0, {}, True),  # a terminal on the main rank
        (None, True, 1, {}, False),  # never off the main rank
        (True, True, 1, {}, False),
        (None, False, 0, {}, False),  # a file or a pipe: silent
        (None, True, 0, {"DDPKIT_PROGRESS": "0"}, False),  # asked to be quiet
        (None, False, 0, {"DDPKIT_PROGRESS": "1"}, True),  # asked to draw into a file
        (None, True, 0, {"DDPKIT_PROGRESS": ""}, True),
        (False, True, 0, {"DDPKIT_PROGRESS": "1"}, False),  # the argument wins
        (True, False, 0, {"DDPKIT_PROGRESS": "0"}, True),
    ],
)
def test_wanted(
    enabled: bool | None, tty: bool, rank: int, environ: dict[str, str], drawn: bool
) -> None:
    stream = _Tty() if tty else io.StringIO()
    assert wanted(enabled, stream, rank, environ) is drawn


def test_bad_variable_names_it_and_its_value() -> None:
    with pytest.raises(ConfigError, match=r"DDPKIT_PROGRESS='maybe' is not a boolean.*=0"):
        wanted(None, _Tty(), 0, {"DDPKIT_PROGRESS": "maybe"})


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="enabled='no'"):
        ddpkit.progress([], enabled="no")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="every_s=-1"):
        ddpkit.progress([], every_s=-1)


def test_render_shows_position_total_rate_and_eta() -> None:
    line = render("epoch 1", 25, 100, rate=5.0, elapsed_s=5.0, width=80)
    assert line.startswith("epoch 1:  25%|")
    assert line.endswith(" 25/100 [00:05<00:15, 5.0 it/s]")
    assert len(line) == 80
    assert "#" * 5 in line and "#" * 15 not in line  # a quarter of the bar
    assert render("", 3, None, rate=0.0, elapsed_s=61.0, width=80) == "3 [01:01, ? it/s]"
    assert render("x", 1, 2, rate=0.0, elapsed_s=0.0, width=80).endswith("1/2 [00:00<?, ? it/s]")
    narrow = render("epoch 1", 25, 100, rate=5.0, elapsed_s=5.0, width=30)
    assert len(narrow) <= 30 and "|" not in narrow


def test_forced_into_a_file_writes_whole_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    ticks = iter(range(100))
    out = io.StringIO()
    bar = Progress(
        range(4), total=None, desc="d", enabled=True, stream=out, every_s=0.0,
        clock=lambda: float(next(ticks)) * 20,  # 20 s per tick: every step is past 10 s
    )  # fmt: skip
    assert list(bar) == [0, 1, 2, 3]
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines[0].endswith(" 0/4 [00:00<?, ? it/s]")
    assert lines[-1].endswith(" 4/4 [01:40<00:00, 0.0 it/s]")  # 4 items in 100 s
    assert len(lines) == 6  # start, 4 steps, the final line


def _tty_worker(rank: int, world_size: int, port: int, tty_name: str) -> dict[str, Any]:
    import sys

    ddpkit.init(env=torchrun_env(rank, world_size, port))
    try:
        data = ddpkit.loader(Indices(10), 1, shuffle=False)  # 5 batches per rank
        for done, _ in enumerate(data, start=1):
            if done == 2:
                break
        saved = data.state_dict()
        data = ddpkit.loader(Indices(10), 1, shuffle=False)
        data.load_state_dict(saved)  # the next pass resumes at batch 2 of 5
        with open(tty_name, "w") as tty:
            sys.stderr = tty  # the default stream: a real terminal
            gathered = [
                ddpkit.gather(batch).tolist()
                for batch in ddpkit.progress(data, f"tty-rank{rank}", every_s=0)
            ]
            for _ in ddpkit.progress(range(3), f"off-rank{rank}", enabled=False, every_s=0):
                pass
            with open(os.devnull, "w") as devnull:
                sys.stderr = devnull  # not a terminal: nothing may reach the tty either
                for _ in ddpkit.progress(range(3), f"pipe-rank{rank}", every_s=0):
                    pass
            sys.stderr = sys.__stderr__
        return {"gathered": gathered}
    finally:
        ddpkit.shutdown()


@pytest.fixture
def terminal() -> Iterator[tuple[str, list[bytes]]]:
    """A pseudo-terminal's slave name, and what arrives at its master (read in a thread)."""
    master, slave = pty.openpty()
    received: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the slave side is closed everywhere
                return
            if not chunk:
                return
            received.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        yield os.ttyname(slave), received
    finally:
        os.close(slave)
        reader.join(timeout=5)
        os.close(master)


@pytest.mark.multiproc
def test_drawn_on_rank_zero_only_under_two_gloo_ranks(
    terminal: tuple[str, list[bytes]],
) -> None:
    tty_name, received = terminal
    results = run_workers(_tty_worker, 2, tty_name)
    # gather inside the bar's loop still sees the resumed steps: samples 4..9, once each
    assert [row for r in results for row in r["gathered"]] == [[4, 5], [6, 7], [8, 9]] * 2
    os.close(os.open(tty_name, os.O_WRONLY))  # nothing else is written now
    text = b"".join(received).decode()
    assert "tty-rank0" in text, text
    assert "rank1" not in text, text
    assert "off-rank0" not in text and "pipe-rank0" not in text, text
    draws = [part for part in text.split("\r") if part.startswith("tty-rank0")]
    assert draws[0].startswith("tty-rank0:  40%|") and " 2/5 [" in draws[0], draws
    assert " 5/5 [" in draws[-1] and text.endswith("\n"), draws
    assert [d.split("| ")[-1].split(" [")[0] for d in draws] == ["2/5", "3/5", "4/5", "5/5", "5/5"]
