"""One stop-signal vocabulary: the spec, the requeue rules, the latch, the launcher and the task
holder take their signals and defaults from ddpkit.cluster.stop.signals (and ddpkit.contract),
so that a signal the spec accepts is one every side handles, and one change reaches them all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from ddpkit.cluster.stop import signals
from ddpkit.contract import DEFAULT_MAX_REQUEUES, DEFAULT_SIGNAL, SIGNAL_VAR
from ddpkit.jobs.spec import JobSpec
from ddpkit.launch import relay

ROOT = Path(__file__).resolve().parents[3]


def _spec(**fields: object) -> JobSpec:
    return JobSpec.model_validate({"name": "v", "command": ["t.py"], "workdir": "/tmp", **fields})


def test_the_spec_field_is_the_vocabularys_type() -> None:
    annotation = JobSpec.model_fields["signal"].annotation
    assert signals.JobSignal in typing.get_args(annotation)  # the same object, not a copy
    assert set(signals.JOB_SIGNALS) <= set(signals.ALLOWED_SIGNALS)
    assert DEFAULT_SIGNAL in signals.JOB_SIGNALS


@pytest.mark.parametrize("name", signals.JOB_SIGNALS)
def test_a_signal_the_spec_takes_is_one_every_side_handles(name: str) -> None:
    spec = _spec(signal=name)
    sig = signals.parse_signal(name)
    env = {SIGNAL_VAR: spec.signal or ""}
    assert signals.stop_signal(env) == sig  # the guard's and the task holder's reading
    assert signals.stop_signal(env, lenient=True) == sig  # the launcher's first line
    assert sig in relay.FORWARDED  # the launcher relays it (never dies of it)


def test_the_defaults_are_the_contracts() -> None:
    spec = _spec()
    assert spec.signal == DEFAULT_SIGNAL and spec.max_requeues == DEFAULT_MAX_REQUEUES
    assert signals.stop_signal({}) == signals.parse_signal(DEFAULT_SIGNAL)
    assert signals.DEFAULT_MAX_REQUEUES == DEFAULT_MAX_REQUEUES


# Change the one default before anything reads it; every side must follow.
CHANGED = """
import signal, sys
import ddpkit.contract as contract
contract.DEFAULT_SIGNAL = "USR1"
contract.DEFAULT_MAX_REQUEUES = 3
from ddpkit.cluster.stop import signals
from ddpkit.cluster.stop.requeue import max_requeues_from
from ddpkit.jobs.spec import JobSpec
from ddpkit.launch import relay
spec = JobSpec.model_validate({"name": "v", "command": ["t.py"], "workdir": "/tmp"})
held = relay.hold(["run"], {})
print(spec.signal, spec.max_requeues, signals.stop_signal({}).name, held.name,
      max_requeues_from(None, {}))
"""


def test_one_change_of_the_default_reaches_the_spec_the_rules_and_the_launcher() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDPKIT_")}
    done = subprocess.run(
        [sys.executable, "-c", CHANGED], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert done.stdout.split() == ["USR1", "3", "SIGUSR1", "SIGUSR1", "3"], done.stderr
    assert signal.SIGUSR1 in relay.FORWARDED
