"""A file planted in a checkpoint folder, met by every ddpkit call that reads the folder.

The planted files are those of ``test_checkpoint_trust`` (real pickles whose unpickling runs
code that creates a marker file). Here each one meets every entry point in turn: a sync save,
an async save, the list and origin helpers, a load of the folder and a load of the file itself.
The marker must never appear, and a load that meets the file by name must refuse it in one line
naming it. (No ``ddpkit`` command reads checkpoint files: ``doctor`` only measures a folder's
free space.)

A planted file can also claim any place in the write order, by its name. One that claims the
last place a name holds (save number 10**18 - 1) would make every later save's name one that is
not read as a checkpoint: the run's own saves would be invisible, and a load after the planted
file was gone would train from scratch. A save refuses to be ordered after such a file, saying
which file and why.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import ddpkit
from ddpkit.errors import CheckpointError
from ddpkit.worker import ckptfiles
from ddpkit.worker.checkpoint import checkpoint_files
from tests.worker.test_checkpoint_trust import KINDS, _plant, planted_name


def _quietly(call: Any, *args: Any, **kwargs: Any) -> Any:
    """``call(*args, **kwargs)`` with its warnings (skipped files, higher steps) kept apart."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return call(*args, **kwargs)


@pytest.mark.parametrize("kind", KINDS)
def test_no_entry_point_runs_a_planted_file(tmp_path: Path, kind: str) -> None:
    marker = tmp_path / "marker"
    folder = tmp_path / "ckpt"
    ddpkit.save_checkpoint(folder, {"w": torch.ones(2)}, step=5)
    planted = _plant(folder / planted_name(kind), kind, marker)

    keep = {"keep_last": 10}  # the planted file stays through both saves
    _quietly(ddpkit.save_checkpoint, folder, {"w": torch.ones(2) * 6}, step=6, **keep)
    assert not marker.exists(), "a sync save ran the planted file"
    pending = _quietly(
        ddpkit.async_save_checkpoint, folder, {"w": torch.ones(2) * 7}, step=7, **keep
    )
    newest = pending.wait()
    assert newest is not None and newest.name.startswith("ckpt-000000007-")
    assert not marker.exists(), "an async save ran the planted file"
    assert planted in checkpoint_files(folder) and checkpoint_files(folder)[-1] == newest
    origin = ddpkit.checkpoint_origin(folder)
    assert origin is not None and origin.path == newest  # saved after it: the newest
    ddpkit.checkpoint_origin(planted)
    assert not marker.exists(), "the list or origin helpers ran the planted file"

    state: dict[str, Any] = {}
    assert _quietly(ddpkit.load_checkpoint, folder, state) == 7
    assert torch.equal(state["w"], torch.ones(2) * 7)
    with pytest.raises(CheckpointError) as caught:  # asked for by name: a one-line refusal
        ddpkit.load_checkpoint(planted, {})
    message = str(caught.value)
    assert "\n" not in message and str(planted) in message, message
    # the weights-only load is the only reader: it refuses the globals it meets, and stops at
    # the first opcode it does not know (a plain pickle's protocol 4): damaged, not run
    if kind.startswith("pickle"):
        assert "cannot be loaded (UnpicklingError: Unsupported operand" in message, message
    else:
        assert " holds " in message and "which load_checkpoint does not unpickle" in message
    assert not marker.exists(), "a load ran the planted file"

    # the planted file does run its code when unpickled as torch.load did by default before 2.6
    # (what the code returns is no checkpoint, so the load may fail after it ran)
    with warnings.catch_warnings(), contextlib.suppress(Exception):
        warnings.simplefilter("ignore")
        torch.load(planted, weights_only=False)
    assert marker.exists(), "the planted file is harmless: this test could not fail"


def _forge(folder: Path, sequence: int) -> Path:
    """A file named as step 1's save number ``sequence``, holding only plain values (it loads
    under weights_only: the worst a forged file can hold)."""
    path = folder / ckptfiles.file_name(1, sequence, None)
    header = {"format": 3, "step": 1, "world_size": 1}
    torch.save({**header, "state": {"w": torch.zeros(2)}, "rng": [{}]}, path)
    return path


_LAST = 10**18 - 1  # the largest save number a name holds (18 digits)


def _sequences(folder: Path) -> dict[str, int]:
    return {entry.path.name: entry.sequence for entry in ckptfiles.written(folder)}


def test_a_planted_last_place_in_the_write_order_cannot_hide_the_runs_own_saves(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "ckpt"
    ddpkit.save_checkpoint(folder, {"w": torch.ones(2)}, step=10)
    planted = _forge(folder, _LAST)
    with pytest.raises(CheckpointError) as caught:
        ddpkit.save_checkpoint(folder, {"w": torch.ones(2) * 2}, step=20)
    message = str(caught.value)
    assert f"{planted} claims to be save number {_LAST} in {folder}" in message, message
    assert "\n" not in message and f"remove {planted}" in (caught.value.hint or "")
    own = "ckpt-000000010-000000001.pt"
    assert sorted(os.listdir(folder)) == [planted.name, own]  # the run's own save untouched

    planted.unlink()  # whoever owns the folder removes it: the run's saves are all there
    ddpkit.save_checkpoint(folder, {"w": torch.ones(2) * 2}, step=20)
    state: dict[str, Any] = {}
    assert ddpkit.load_checkpoint(folder, state) == 20
    assert torch.equal(state["w"], torch.ones(2) * 2)
    assert _sequences(folder) == {own: 1, "ckpt-000000020-000000002.pt": 2}


def test_the_last_sequence_the_reader_takes_is_still_written(tmp_path: Path) -> None:
    """The bound is the name's own: one place below it, a save still takes the last one."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    _forge(folder, _LAST - 1)
    _quietly(ddpkit.save_checkpoint, folder, {"w": torch.ones(2)}, step=0)
    assert _sequences(folder)[f"ckpt-000000000-{_LAST}.pt"] == _LAST  # read back: listed
    assert ddpkit.load_checkpoint(folder, {}) == 0
    with pytest.raises(CheckpointError, match=rf"ckpt-000000000-{_LAST}\.pt claims to be save"):
        ddpkit.save_checkpoint(folder, {"w": torch.ones(2)}, step=3)


def test_a_file_torchs_restricted_reader_cannot_read_is_named_in_one_line(
    tmp_path: Path,
) -> None:
    """ddpkit's head, then opcodes torch's weights-only reader does not know (pickle protocol
    4's FRAME): torch explains on a page; the warning and the error say it in one line."""
    folder = tmp_path / "ckpt"
    ddpkit.save_checkpoint(folder, {"w": torch.ones(2)}, step=5)
    odd = folder / "ckpt-000000006-000000009.pt"
    header = {"format": 3, "step": 6, "world_size": 1}
    torch.save({**header, "state": {}, "rng": [{}]}, odd, pickle_protocol=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ddpkit.load_checkpoint(folder, {}) == 5  # skipped as damaged, the previous loads
    (warning,) = [str(item.message) for item in caught if str(odd) in str(item.message)]
    assert "\n" not in warning and "(UnpicklingError: Unsupported operand" in warning, warning
    with pytest.raises(CheckpointError) as raised:
        ddpkit.load_checkpoint(odd, {})
    message = str(raised.value)
    assert "\n" not in message and len(message) < 700, message
    assert f"checkpoint file {odd} cannot be loaded (UnpicklingError: Unsupported" in message


@pytest.mark.parametrize("call", ["save", "load"])
def test_a_fifo_swapped_in_after_the_listing_never_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: str
) -> None:
    """Someone renames a FIFO over a checkpoint name between the folder's listing (a regular
    file then) and its opening: opening a FIFO to read waits for a writer, for ever. The
    listing is faked to have seen a file there (the swap's window is too short to hit in a
    test); the FIFO and the open are real."""
    folder = tmp_path / "ckpt"
    ddpkit.save_checkpoint(folder, {"w": torch.ones(2)}, step=5)
    fifo = folder / "ckpt-000000006-000000002.pt"
    os.mkfifo(fifo)
    listed = ckptfiles.written

    def written(where: Path) -> list[ckptfiles.Found]:
        found = ckptfiles.parsed(fifo)
        assert found is not None
        return sorted({*listed(where), found})

    monkeypatch.setattr(ckptfiles, "written", written)
    outcome: list[Any] = []

    def run() -> None:
        try:
            if call == "save":
                outcome.append(_quietly(ddpkit.save_checkpoint, folder, {"w": 1}, step=7))
            else:
                outcome.append(_quietly(ddpkit.load_checkpoint, folder, {}))
        except Exception as error:
            outcome.append(error)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout=30)
    if worker.is_alive():  # unblock it: a writer opens the FIFO and leaves at once
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(timeout=30)
        pytest.fail(f"the {call} blocked opening the FIFO {fifo}")
    expected = folder / "ckpt-000000007-000000003.pt" if call == "save" else 5
    assert outcome == [expected]
