"""The masking rule of ``ddpkit env`` (and ``doctor``): hostile names and values, then the real CLI.

The table goes through ``ddpkit.tools.envreport.mask`` (the function ``ddpkit env`` always
used), so it runs against older code too; the CLI runs as a subprocess with the secrets in its
environment and no secret may appear anywhere in its stdout or stderr.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpkit.tools.envreport import mask

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"

JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJzbG9ydW0ifQ.c2lnbmF0dXJlX2hlcmU"
GITHUB = "ghp_" + "A1b2C3d4E5f6G7h8I9j0" * 2
PEM = (
    "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAA\n"
    "-----END OPENSSH PRIVATE KEY-----\n"
)
LONG = "L" * 100_000


def _hidden(value: str) -> str:
    return f"*** ({len(value)} char{'' if len(value) == 1 else 's'})"


# (name, value, the secret parts that must not show, what is shown)
NAMES = [
    ("SLURM_JWT", JWT, [JWT], _hidden(JWT)),
    ("NCCL_PASSPHRASE", "correct horse", ["correct", "horse"], _hidden("correct horse")),
    ("SLURM_PASS", "pw1", ["pw1"], _hidden("pw1")),
    ("DB_PASSWD", "pw2", ["pw2"], _hidden("pw2")),
    ("PGPASSWORD", "pw3", ["pw3"], _hidden("pw3")),  # one word, ends with PASSWORD
    ("MYSQL_PWD", "pw4", ["pw4"], _hidden("pw4")),
    ("WANDB_API_KEY", "k1", ["k1"], _hidden("k1")),
    ("DDPKIT_APIKEY", "k2", ["k2"], _hidden("k2")),
    ("AWS_SECRET_ACCESS_KEY", "s1", ["s1"], _hidden("s1")),
    ("AWS_SESSION_TOKEN", "t1", ["t1"], _hidden("t1")),
    ("HF_TOKEN", "", [], _hidden("")),  # empty: still only the length
    ("GOOGLE_APPLICATION_CREDENTIALS", "/k.json", ["/k.json"], _hidden("/k.json")),
    ("DDPKIT_DB_CREDS", "c1", ["c1"], _hidden("c1")),
    ("TORCH_AUTH", "a1", ["a1"], _hidden("a1")),
    ("NCCL_OAUTH", "a2", ["a2"], _hidden("a2")),
    ("DDPKIT_COOKIE", "c=2", ["c=2"], _hidden("c=2")),
    ("BW_SESSION", "b1", ["b1"], _hidden("b1")),
    ("SSH_PRIVATE", "p1", ["p1"], _hidden("p1")),
    ("SLURM_JOB_KEY", "j1", ["j1"], _hidden("j1")),  # harmless or not: KEY is hidden
    ("clientSecret", "c3", ["c3"], _hidden("c3")),  # camelCase words
    ("x-api-key", "k3", ["k3"], _hidden("k3")),
    ("DDPKIT_TOKEN", "tok\nen", ["tok", "en"], _hidden("tok\nen")),  # a newline inside
    ("DDPKIT_TOKEN", LONG, [LONG[:50]], _hidden(LONG)),
]
NOT_SECRET_NAMES = [
    "KEYBOARD_LAYOUT",
    "TOKENIZERS_PARALLELISM",
    "GIT_AUTHOR_NAME",
    "PWD",
    "OLDPWD",
    "SLURM_SIGNAL",
    "DDPKIT_SLURM_KEEP",
    "BYPASS_CACHE",
    "CUDA_LINK_LIBRARIES_KEYWORD",
    "NCCL_IB_PKEY",  # NOT_SECRET: settings the word rule would catch
    "SLURM_WCKEY",
    "TORCH_COMPILE_CACHE_KEY_TAG",
]
VALUES = [
    # URL userinfo runs to the LAST @: the password may hold @, /, spaces, newlines
    ("https://user:pa@ss@host/", ["pa@ss", "ss@"], "https://user:***@host/"),
    ("https://user:p%40ss@host/", ["p%40ss"], "https://user:***@host/"),
    ("https://user:pa/ss@host/x", ["pa/ss", "ss@"], "https://user:***@host/x"),
    ("https://user:p ss@host/", ["p ss", "ss@"], "https://user:***@host/"),
    ("https://user:pa\nss@host/", ["pa\nss", "ss@"], "https://user:***@host/"),
    ("https://user:@host/", [], "https://user:***@host/"),  # empty password
    ("https://:pw@host/", [":pw"], "https://:***@host/"),
    ("https://us:er:pw@host:8080/", ["er:pw"], "https://us:***@host:8080/"),
    (f"https://{GITHUB}@github.com/o/r.git", [GITHUB], "https://***@github.com/o/r.git"),
    ("redis://u:one@h1,redis://u:two@h2/0", ["one", "two"], "redis://u:***@h1,redis://u:***@h2/0"),
    (f"https://u:{LONG}@host/", [LONG[:50]], "https://u:***@host/"),
    # without a scheme: user:password@host[:port]
    ("user:pass@host:29500", ["pass"], "user:***@host:29500"),
    ("user:pa@ss@host", ["pa@ss", "ss@"], "user:***@host"),
    ("--store=user:pw9@n1:5", ["pw9"], "--store=user:***@n1:5"),
    # Authorization / Bearer, and key=value pairs whose key looks secret
    ("Bearer abc.def-ghi", ["abc.def-ghi"], "Bearer ***"),
    ("Authorization: Bearer tok123", ["tok123"], "Authorization: Bearer ***"),
    ("Authorization: Basic dXNlcjpwYXNz", ["dXNlcjpwYXNz"], "Authorization: Basic ***"),
    ("password=hunter2;user=me", ["hunter2"], "password=***;user=me"),
    ('{"api_key": "abc123", "n": 1}', ["abc123"], '{"api_key": "***", "n": 1}'),
    ("https://h/x?token=abc123&page=2", ["abc123"], "https://h/x?token=***&page=2"),
    (
        "s3://b/k?X-Amz-Credential=AKIA0/x&X-Amz-Signature=f00d",
        ["AKIA0", "f00d"],
        "s3://b/k?X-Amz-Credential=***&X-Amz-Signature=***",
    ),
    ("--export=ALL,HF_TOKEN=hf9,X=1", ["hf9"], "--export=ALL,HF_TOKEN=***,X=1"),
    # credential shapes anywhere
    (f"jwt {JWT} here", [JWT], "jwt *** here"),
    (GITHUB, [GITHUB], "***"),
    (PEM, ["b3BlbnNzaC1rZXktdjEAAAA"], _hidden(PEM)),
]
UNCHANGED = [
    "n1",
    "127.0.0.1",
    "INFO",
    "eth0,ib0",
    "10.0.0.1:29500",
    "git@github.com:o/r.git",
    "someone@example.com",
    "http://[::1]:29500/",
    "expandable_segments:True",
    "tcp://n1:29500",
    "Basic setup",
]


@pytest.mark.parametrize(("name", "value", "secrets", "shown"), NAMES)
def test_a_secret_name_hides_the_whole_value(
    name: str, value: str, secrets: list[str], shown: str
) -> None:
    assert mask(name, value) == shown
    assert not any(secret in mask(name, value) for secret in secrets)


@pytest.mark.parametrize("name", NOT_SECRET_NAMES)
def test_names_that_only_look_secret(name: str) -> None:
    assert mask(name, "value-1") == "value-1"


@pytest.mark.parametrize(("value", "secrets", "shown"), VALUES)
def test_credentials_inside_values(value: str, secrets: list[str], shown: str) -> None:
    for name in ("DDPKIT_STORE", "MASTER_ADDR", "NCCL_DEBUG"):
        got = mask(name, value)
        assert got == shown, name
        assert not any(secret in got for secret in secrets), got
        assert mask(name, got) == got  # masking what is shown changes nothing


@pytest.mark.parametrize("value", UNCHANGED)
def test_values_without_credentials_are_shown_as_they_are(value: str) -> None:
    assert mask("DDPKIT_STORE", value) == value


def test_masking_stays_linear_on_hostile_values() -> None:
    """128 KiB (the kernel's limit for one variable) of repeats that would make a careless
    regex quadratic: each within a generous bound on a loaded machine."""
    from ddpkit.masking import mask_text

    for value in ("k=" * 65_000, "a" * 131_000, "a:" + "b@" * 65_000, "://" * 43_000,
                  "https://" + "u:p@" * 30_000, "password=" * 14_000, "eyJ" * 43_000):  # fmt: skip
        started = time.perf_counter()
        mask_text(value)
        assert time.perf_counter() - started < 5.0, value[:20]


def test_printable_escapes_control_characters() -> None:
    from ddpkit.masking import printable

    assert printable("a\nb\r\x1b[2Kc\td\x85") == "a\\nb\\r\\x1b[2Kc\\td\\x85"
    assert printable("plain value") == "plain value"


# --- the real CLI, in a subprocess ----------------------------------------------------------

SECRETS = {
    "SLURM_JWT": JWT,
    "NCCL_PASSPHRASE": "Passphrase-7f3a",
    "SLURM_PASS": "SlurmPass-91c2",
    "TORCH_HF_TOKEN": "hf-Token-55e1",
    "DDPKIT_STORE": "https://alice:Url-Pw@ss-0b7d@store.example:443/x",
    "DDPKIT_BARE": "alice:Bare-Pw@n1:29500",
    "DDPKIT_HEADER": "Authorization: Bearer Bearer-Tok-3e9f",
    "NCCL_NET_URL": "redis://bob:Redis%40Pw-11aa@n2:6379/0",
    "DDPKIT_LONG": f"https://carol:{'Long-Pw-' * 12_000}@n3/",
    "DDPKIT_MULTI": "line one\nSLURM_FAKE: Injected-Line-6d4c",
}
LEAKS = ["Passphrase-7f3a", "SlurmPass-91c2", "hf-Token-55e1", "Url-Pw", "ss-0b7d", "Bare-Pw",
         "Bearer-Tok-3e9f", "Redis%40Pw-11aa", "Long-Pw-", JWT[:20], JWT[-12:]]  # fmt: skip


@pytest.mark.parametrize(
    "flags", [[], ["--json"], ["--no-torch"], ["--json", "--no-torch"]], ids=" ".join
)
def test_ddpkit_env_prints_no_secret(flags: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(SRC), **SECRETS}
    done = subprocess.run(
        [sys.executable, "-m", "ddpkit", "env", *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert [leak for leak in LEAKS if leak in output] == []
    shown = (
        json.loads(done.stdout)["variables"]
        if "--json" in flags
        else dict(
            line.strip().split(": ", 1)
            for line in done.stdout.split("## variables", 1)[1].split("\n## ", 1)[0].splitlines()
            if line.strip()
        )
    )
    assert shown["SLURM_JWT"] == _hidden(JWT)
    assert shown["DDPKIT_STORE"] == "https://alice:***@store.example:443/x"  # user and host
    assert shown["DDPKIT_BARE"] == "alice:***@n1:29500"
    assert shown["DDPKIT_HEADER"] == "Authorization: Bearer ***"
    assert shown["NCCL_NET_URL"] == "redis://bob:***@n2:6379/0"
    if "--json" not in flags:  # one variable, one line: the newline is shown escaped
        assert shown["DDPKIT_MULTI"] == "line one\\nSLURM_FAKE: Injected-Line-6d4c"
        assert not any(line.startswith("SLURM_FAKE") for line in done.stdout.splitlines())


def test_ddpkit_env_masks_a_master_addr_with_credentials_everywhere() -> None:
    """MASTER_ADDR reaches the launcher and network sections (and an error) too."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "MASTER_ADDR": "https://u:Master-Pw-42@n1/",
           "MASTER_PORT": "29500", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
           "LOCAL_WORLD_SIZE": "2"}  # fmt: skip
    for flags in (["--no-torch"], ["--json", "--no-torch"]):
        done = subprocess.run(
            [sys.executable, "-m", "ddpkit", "env", *flags],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert "Master-Pw-42" not in done.stdout + done.stderr
        assert "https://u:***@n1/" in done.stdout


def test_doctor_masks_what_it_prints() -> None:
    from ddpkit.tools.doctor import DoctorOptions, run_doctor

    env = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "u:Doctor-Pw-17@127.0.0.1", "MASTER_PORT": "9"}  # fmt: skip
    report = run_doctor(DoctorOptions(timeout_s=1.0, comm=False), env)
    assert "Doctor-Pw-17" in json.dumps([c.detail for c in report.checks])  # it was there
    for shown in (report.text(), report.text(problems_only=True), report.to_json()):
        assert "Doctor-Pw-17" not in shown and "u:***@127.0.0.1" in shown


def test_ddpkit_plan_masks_the_spec_and_dry_run_stays_literal(tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(
        "name: t\ncommand: [train.py, --api-key=Cmd-Key-5a]\n"
        "env:\n  WANDB_API_KEY: Env-Key-6b\n  DB_URL: 'https://u:Url-Pw-7c@db/x'\n"
        "  NCCL_DEBUG: INFO\nsetup:\n  - export HF_TOKEN=Setup-Tok-8d\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    plan = subprocess.run(
        [sys.executable, "-m", "ddpkit", "plan", str(spec)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert plan.returncode == 0, plan.stderr
    leaks = ["Cmd-Key-5a", "Env-Key-6b", "Url-Pw-7c", "Setup-Tok-8d"]
    assert [leak for leak in leaks if leak in plan.stdout + plan.stderr] == []
    for shown in ("WANDB_API_KEY: '*** (10 chars)'", "DB_URL: https://u:***@db/x",
                  "NCCL_DEBUG: INFO", "export HF_TOKEN=***", "--api-key=***"):  # fmt: skip
        assert shown in plan.stdout
    dry = subprocess.run(
        [sys.executable, "-m", "ddpkit", "submit", str(spec), "--dry-run"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert dry.returncode == 0, dry.stderr
    assert all(leak in dry.stdout for leak in leaks)  # the literal script: a documented choice
