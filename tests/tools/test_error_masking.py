"""Error messages that quote a variable's or a spec field's value show it by the masking rule.

``ddpkit env`` and ``doctor`` mask what they print (test_envreport_masking.py); a one-line
error naming the bad value must not undo that: a MASTER_ADDR with a password in it, a secret
variable of a spec's ``env:`` with a bad value, a flag holding a URL with credentials. Each
case runs as the user meets it: ``ddpkit.init()`` in a real process, the ``ddpkit`` CLI in a
real process; the secret may appear nowhere in stdout or stderr (traceback included).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit.cluster.envvars import parse_int
from ddpkit.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
TOKEN = "hf_" + "Spec0Token0Leak" * 2


def _run(argv: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {key: value for key, value in os.environ.items()
             if key not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                            "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"}}  # fmt: skip
    return subprocess.run(
        [sys.executable, *argv],
        env={**clean, "PYTHONPATH": str(SRC), **env},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_init_error_masks_a_master_addr_with_credentials(tmp_path: Path) -> None:
    """torch's env:// variables, one missing: the error names those set, the password hidden
    (up to the last '@', the password holds one)."""
    done = _run(
        ["-c", "import ddpkit; ddpkit.init()"],
        tmp_path,
        RANK="0",
        WORLD_SIZE="2",
        MASTER_ADDR="https://alice:Init-Pw@ss-3c@n1/",
    )
    output = done.stdout + done.stderr
    assert "ConfigError" in output and "not MASTER_PORT" in output, output
    assert "Init-Pw" not in output and "ss-3c" not in output, output
    assert "MASTER_ADDR='https://alice:***@n1/'" in output


@pytest.mark.parametrize(
    ("env_yaml", "set_flags", "shown"),
    [
        (f"  HF_TOKEN: [{TOKEN}]\n", [], "env.HF_TOKEN=***: is not a string"),
        (
            "  NCCL_DEBUG: INFO\n",
            [f"env.WANDB_API_KEY=[{TOKEN}]"],
            "env.WANDB_API_KEY=***: is not a string",
        ),
        (f"  DB_URL: [https://u:{TOKEN}@db/x]\n", [], "env.DB_URL=['https://u:***@db/x']"),
    ],
    ids=["spec", "--set", "url"],
)
def test_a_spec_error_hides_the_secret_it_quotes(
    tmp_path: Path, env_yaml: str, set_flags: list[str], shown: str
) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(f"name: t\ncommand: [train.py]\nenv:\n{env_yaml}")
    sets = [arg for flag in set_flags for arg in ("--set", flag)]
    done = _run(["-m", "ddpkit", "plan", str(spec), *sets], tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert TOKEN not in output and "Spec0Token" not in output, output
    assert shown in output, output
    assert len(done.stderr.splitlines()) == 1, output


def test_a_launcher_flag_error_hides_url_credentials(tmp_path: Path) -> None:
    done = _run(
        ["-m", "ddpkit", "run", "--rdzv-endpoint", "https://bob:Flag-Pw@x-9@n1:1/", "t.py"],
        tmp_path,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert "Flag-Pw" not in output and "x-9" not in output, output
    assert "--rdzv-endpoint='https://bob:***@n1:1/' is not HOST[:PORT]" in output, output


@pytest.mark.parametrize(
    ("name", "value", "shown"),
    [
        ("SLURM_JWT", "eyJx.y", "SLURM_JWT='*** (6 chars)'"),
        ("MASTER_ADDR", "u:p@ss@n1", "MASTER_ADDR='u:***@n1'"),
        ("MASTER_PORT", "29500x", "MASTER_PORT='29500x'"),  # nothing secret: shown as it is
        ("--master-addr", "https://u:pw@h/", "--master-addr='https://u:***@h/'"),
    ],
)
def test_assignment_follows_the_masking_rule(name: str, value: str, shown: str) -> None:
    from ddpkit.masking import assignment

    assert assignment(name, value) == shown


def test_a_numeric_variable_error_goes_through_the_rule() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_int("DDPKIT_API_TOKEN", "Tok-5e", hint="a number")
    assert "Tok-5e" not in str(caught.value)
    assert "DDPKIT_API_TOKEN='*** (6 chars)' is not an integer" in str(caught.value)
