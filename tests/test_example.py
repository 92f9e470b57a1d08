"""The example's settings beyond the README's launch: `examples/train.py` with FSDP2 in bf16
with accumulation, and in bf16 compiled with accumulation, in 2 ranks forked from the fork
server (tests/support/example.py); `--strategy dp` in one; its refusal of a bad `--accumulate`.

The README's launch itself, `ddpkit run --nproc-per-node 2 examples/train.py --epochs 3`
(2001 test samples are odd, so the sampler pads one for 2 ranks and the count proves the
padding removed; the stated accuracy), is checked in tests/worker/test_resume.py, where it is
also the uninterrupted run that the killed and stopped runs must end the same as: one launch
for both. The launcher is what that launch tests; a launch of this short example costs about as
much CPU whatever its settings, nearly all of it torch's import in the agent and in each
worker. (A 3-rank launch was here too, for no other guarantee: 2001 divides by 3, so it padded
nothing the 2-rank run does not; the 3-rank example runs in tests/worker/test_resume.py's
exact-resume test.)"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from tests.support.example import run_example

ROOT = Path(__file__).resolve().parents[1]
STATED_ACCURACY = 0.88  # docs/guide/quickstart.md states the example reaches this on CPU


@pytest.mark.multiproc
def test_example_trains_sharded_with_strategy_fsdp(tmp_path: Path) -> None:
    """--strategy fsdp --accumulate 2 --precision bf16 (docs/guide/loop.md's command): the
    same script with FSDP2 in bf16, its checkpoints saved by both ranks at windows' ends."""
    ckpt = tmp_path / "ckpt"
    flags = ["--strategy", "fsdp", "--accumulate", "2", "--precision", "bf16"]
    sizes = ["--epochs", "1", "--train-size", "1024"]
    saving = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "1"]
    out = run_example(2, [*flags, *sizes, *saving])
    assert "eval: 2001 samples (test set has 2001)" in out, out
    assert re.search(r"^\[rank0\]:? ?weights sha256: [0-9a-f]{64}$", out, re.MULTILINE), out
    # 8 batches a rank make 4 windows, a step each: steps 2, 3 and 4 kept (keep_last=3), each a
    # file and its folder; step 1's folder is pruned
    kept = sorted((int(path.name.split("-")[1]), path.suffix) for path in ckpt.iterdir())
    assert kept == [(step, kind) for step in (2, 3, 4) for kind in (".dcp", ".pt")], kept


def test_example_with_strategy_dp_in_one_process() -> None:
    """--strategy dp is one process's (DataParallel over its GPUs; the plain model on a CPU,
    with a warning), with accumulation and bf16 as under the other strategies."""
    flags = ["--strategy", "dp", "--accumulate", "2", "--precision", "bf16"]
    out = run_example(1, [*flags, "--epochs", "1", "--train-size", "512"])
    assert "eval: 2001 samples (test set has 2001)" in out, out
    assert re.search(r"^\[rank0\]:? ?weights sha256: [0-9a-f]{64}$", out, re.MULTILINE), out


def test_accumulate_below_one_is_refused_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The example's ``main()`` in this process: argparse's refusal (exit code 2), before
    ``ddpkit.init()`` is called (here it fails the test if it is)."""
    spec = importlib.util.spec_from_file_location("train_example", ROOT / "examples" / "train.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    def started(*args: object, **kwargs: object) -> None:
        raise AssertionError("ddpkit.init() was called before --accumulate was checked")

    monkeypatch.setattr(example.ddpkit, "init", started)
    monkeypatch.setattr(sys, "argv", ["examples/train.py", "--accumulate", "0"])
    with pytest.raises(SystemExit) as refused:
        example.main()
    assert refused.value.code == 2, capsys.readouterr()
    assert "--accumulate=0 must be at least 1" in capsys.readouterr().err


@pytest.mark.multiproc
def test_example_in_bf16_compiled_with_accumulation() -> None:
    # aot_eager: dynamo and AOTAutograd without inductor's code generation (minutes on CPU)
    flags = ["--precision", "bf16", "--compile", "aot_eager", "--accumulate", "2", "--epochs", "2"]
    out = run_example(2, flags)
    found = re.search(r"eval: (\d+) samples \(test set has (\d+)\), accuracy ([0-9.]+)", out)
    assert found, out
    assert int(found[1]) == int(found[2]) == 2001
    assert float(found[3]) >= STATED_ACCURACY  # bf16 trains as well as float32 here
    assert re.search(r"weights sha256: [0-9a-f]{64}", out), out
