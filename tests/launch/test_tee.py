"""How ``ddpkit run`` prints its workers' lines (:mod:`ddpkit.launch.tee`): one rank prefix a
line, whole lines, progress bars redrawn in place. In-process: a real log file tailed by the
real function in a thread (``tests/test_compat.py`` checks that torch's ``TailLog`` calls it)."""

from __future__ import annotations

import io
import subprocess
import threading
import time
from pathlib import Path

import pytest

from ddpkit.launch import tee


@pytest.mark.parametrize(
    ("written", "shown"),
    [
        # torch's excepthook prefix and its C++ log prefix of the same rank: dropped once
        ("[rank0]: [rank0]: Traceback (most recent call last):\n", "[rank0]: Traceback (most"),
        ("[rank1]: [rank1]:[W1201 23:29:06.1 socket.cpp:955] x\n", "[rank1]: [W1201 23:29:06.1"),
        ("[rank1]: [rank1]:[W1201 x\n", "[rank1]: [W1201 x"),
        # another rank's prefix, a prefix in the middle, another template: left alone
        ("[rank1]: [rank0]:[W1201 x\n", "[rank1]: [rank0]:[W1201 x"),
        ("[rank0]: text [rank0]: more\n", "[rank0]: text [rank0]: more"),
        ("[default0]:[rank0]: x\n", "[default0]:[rank0]: x"),
    ],
)
def test_torchs_own_rank_prefix_is_printed_once(written: str, shown: str) -> None:
    once = tee.once_prefixed(written)
    assert once.startswith(shown), once
    assert once.count("\n") == 1


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("loss 0.5\n", "[rank0]: loss 0.5\n"),
        ("\r 10%|#", "\r[rank0]:  10%|#"),  # a redraw: the header after the carriage return
        ("\r 10%|#\r 20%|##", "\r[rank0]:  10%|#\r[rank0]:  20%|##"),
        ("\r100%|###\n", "\r[rank0]: 100%|###\n"),
        ("epoch 1\r\n", "[rank0]: epoch 1\r\n"),  # a CRLF ending is no redraw
        ("done\r", "[rank0]: done\r"),  # nothing follows the carriage return yet
    ],
)
def test_a_redraw_gets_its_header_after_the_carriage_return(text: str, shown: str) -> None:
    assert tee.prefixed("[rank0]: ", text) == shown


def _tail(log: Path, out: io.StringIO) -> tuple[threading.Event, threading.Thread]:
    finished = threading.Event()
    thread = threading.Thread(
        target=tee.tail_whole_lines,
        args=("[rank0]: ", str(log), out, finished, 0.1, lambda _line: True),
    )
    thread.start()
    return finished, thread


def _until(out: io.StringIO, text: str) -> None:
    deadline = time.monotonic() + 30
    while text not in out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert text in out.getvalue(), out.getvalue()


def test_a_progress_bar_is_redrawn_in_place_and_lines_stay_whole(tmp_path: Path) -> None:
    log = tmp_path / "0.log"
    log.write_text("")
    out = io.StringIO()
    finished, thread = _tail(log, out)
    try:
        with log.open("a", newline="") as worker:  # as a worker writes: no newline translation
            for percent in (0, 50):
                worker.write(f"\rprogress {percent}%")
                worker.flush()
                # each redraw is printed at once, without waiting for a newline or the hold
                _until(out, f"\r[rank0]: progress {percent}%")
            worker.write("\rprogress 100%")
            worker.flush()
            _until(out, "progress 100%")
            worker.write("\n")  # the bar's last newline, written apart: it ends the same line
            worker.write("loss 0.5")
            worker.flush()
            time.sleep(0.3)  # 3 polls see the piece: it is held for its end
            worker.write(" at step 3\n")
            worker.flush()
            _until(out, "step 3")
    finally:
        finished.set()
        thread.join(timeout=30)
    assert out.getvalue() == (
        "\r[rank0]: progress 0%\r[rank0]: progress 50%\r[rank0]: progress 100%\n"
        "[rank0]: loss 0.5 at step 3\n"
    )
    # on a terminal: two lines, each with one prefix (each carriage return goes back to its start)
    shown = [line.rsplit("\r", 1)[-1] for line in out.getvalue().split("\n")[:-1]]
    assert shown == ["[rank0]: progress 100%", "[rank0]: loss 0.5 at step 3"]


def test_pid_in_the_prefix_is_the_process_writing_the_file(tmp_path: Path) -> None:
    # the worker: a child of this process whose stdout is the log, as torch's agent starts it
    log = tmp_path / "stdout.log"
    err = tmp_path / "stderr.log"
    wait = tmp_path / "go"
    script = f"echo first; while [ ! -e '{wait}' ]; do sleep 0.05; done; echo second"
    with log.open("w") as stdout, err.open("w") as stderr:
        worker = subprocess.Popen(["sh", "-c", script], stdout=stdout, stderr=stderr)
    out = io.StringIO()
    finished = threading.Event()
    thread = threading.Thread(
        target=tee.tail_whole_lines,
        args=("[n1 ${pid} rank0]: ", str(log), out, finished, 0.1, lambda _line: True),
    )
    thread.start()
    try:
        assert tee.writer_pid(str(log)) == worker.pid
        assert tee.writer_pid(str(err)) == worker.pid  # its stderr, fd 2
        _until(out, "first")
        wait.write_text("")
        assert worker.wait(timeout=30) == 0
        _until(out, "second")
    finally:
        finished.set()
        thread.join(timeout=30)
    prefix = f"[n1 {worker.pid} rank0]: "
    assert out.getvalue() == f"{prefix}first\n{prefix}second\n"  # resolved once, kept
    assert tee.writer_pid(str(log)) is None  # gone: nobody writes it now
    assert tee.writer_pid(str(tmp_path / "none.log")) is None
