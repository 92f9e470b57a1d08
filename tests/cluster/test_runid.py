"""The run's identity from the environment (ddpkit.cluster.runid): where the id comes from in
each launch, the attempt across SLURM requeues and agent restarts, and bad values refused."""

from __future__ import annotations

import pytest

from ddpkit.cluster.runid import RunIdentity, check_run_id, launch_run_id, run_identity
from ddpkit.errors import ConfigError


def fresh() -> str:
    return "run-fresh"


SLURM = {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
ARRAY = {**SLURM, "SLURM_ARRAY_JOB_ID": "4240", "SLURM_ARRAY_TASK_ID": "2"}
AGENT = {"TORCHELASTIC_RUN_ID": "0f5c-uuid", "TORCHELASTIC_MAX_RESTARTS": "3"}


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, RunIdentity("run-fresh", 0, source="fresh")),
        (SLURM, RunIdentity("slurm-4242", 0, source="slurm")),
        ({**SLURM, "SLURM_RESTART_COUNT": "2"}, RunIdentity("slurm-4242", 2, 2, 0, "slurm")),
        (ARRAY, RunIdentity("slurm-4240_2", 0, source="slurm")),
        ({**ARRAY, "SLURM_RESTART_COUNT": "1"}, RunIdentity("slurm-4240_2", 1, 1, 0, "slurm")),
        # torchrun / ddpkit run outside SLURM: the rendezvous id, the agent's restart count
        ({**AGENT, "TORCHELASTIC_RESTART_COUNT": "0"}, RunIdentity("0f5c-uuid", 0, 0, 0, "agent")),
        ({**AGENT, "TORCHELASTIC_RESTART_COUNT": "2"}, RunIdentity("0f5c-uuid", 2, 0, 2, "agent")),
        # torch's placeholder rendezvous id names no run; nor does an unusable one
        ({"TORCHELASTIC_RUN_ID": "none"}, RunIdentity("run-fresh", 0, source="fresh")),
        ({"TORCHELASTIC_RUN_ID": "a/b:c"}, RunIdentity("run-fresh", 0, source="fresh")),
        # ddpkit run inside a requeued SLURM job: each requeue a block of max_restarts + 1
        (
            {**SLURM, **AGENT, "SLURM_RESTART_COUNT": "1", "TORCHELASTIC_RESTART_COUNT": "2"},
            RunIdentity("slurm-4242", 6, 1, 2, "slurm"),
        ),
        # the user's id wins over every launcher's
        ({**ARRAY, **AGENT, "DDPKIT_RUN_ID": "bert-3"}, RunIdentity("bert-3", 0, source="user")),
        # what `ddpkit run` exported (DDPKIT_RUN_ID) and the agent's restart count
        (
            {"DDPKIT_RUN_ID": "abc", **AGENT, "TORCHELASTIC_RESTART_COUNT": "1"},
            RunIdentity("abc", 1, 0, 1, "user"),
        ),
        ({"DDPKIT_RUN_ID": ""}, RunIdentity("run-fresh", 0, source="fresh")),  # empty: unset
    ],
)
def test_run_identity_by_launch(env: dict[str, str], expected: RunIdentity) -> None:
    assert run_identity(env, fresh=fresh) == expected


def test_a_requeue_and_an_agent_restart_keep_the_id_and_count_up() -> None:
    attempts = [
        run_identity({**SLURM, **AGENT, **counts}, fresh=fresh)
        for counts in (
            {},
            {"TORCHELASTIC_RESTART_COUNT": "1"},
            {"SLURM_RESTART_COUNT": "1", "TORCHELASTIC_RESTART_COUNT": "0"},
            {"SLURM_RESTART_COUNT": "1", "TORCHELASTIC_RESTART_COUNT": "3"},
            {"SLURM_RESTART_COUNT": "2"},
        )
    ]
    assert {identity.run_id for identity in attempts} == {"slurm-4242"}
    numbers = [identity.attempt for identity in attempts]
    assert numbers == sorted(set(numbers)) == [0, 1, 4, 7, 8]


def test_a_fresh_id_is_fresh_each_time() -> None:
    first, second = run_identity({}), run_identity({})
    assert first.source == second.source == "fresh"
    assert first.run_id != second.run_id and first.run_id.startswith("run-")
    assert check_run_id(first.run_id) == first.run_id


@pytest.mark.parametrize(
    "value",
    ["has space", "-leading-dash", ".hidden", "a/b", "x" * 129, "naïve", "a\nb", "run;rm"],
)
def test_a_bad_user_run_id_is_one_config_error(value: str) -> None:
    with pytest.raises(ConfigError) as caught:
        run_identity({"DDPKIT_RUN_ID": value})
    message = str(caught.value)
    assert "DDPKIT_RUN_ID=" in message and "is not a usable run id" in message
    assert "\n" not in caught.value.message and caught.value.hint
    assert len(message) < 600  # a 10 kB value is cut, not echoed whole


@pytest.mark.parametrize("value", ["a", "x" * 128, "bert_large.v2-3", "9"])
def test_good_run_ids_pass(value: str) -> None:
    assert run_identity({"DDPKIT_RUN_ID": value}).run_id == value


@pytest.mark.parametrize(
    "bad",
    [
        {"SLURM_RESTART_COUNT": "one"},
        {"TORCHELASTIC_RESTART_COUNT": "1.5"},
        {"SLURM_JOB_ID": "12x"},
        {"SLURM_ARRAY_JOB_ID": "12", "SLURM_ARRAY_TASK_ID": "a"},
    ],
)
def test_bad_counters_and_job_ids_are_config_errors_naming_them(bad: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match=next(iter(reversed(bad)))):
        run_identity(bad)


def test_the_launcher_fixes_one_id_per_launch() -> None:
    # one node, no SLURM: the rendezvous id (standalone: torch's fresh uuid), else a fresh one
    assert launch_run_id({}, "5e1a-uuid", one_node=True) == "5e1a-uuid"
    made = launch_run_id({}, "none", one_node=True)
    assert made is not None and made.startswith("run-")
    # several nodes without --rdzv-id cannot agree on a fresh one: the workers do
    assert launch_run_id({}, "none", one_node=False) is None
    assert launch_run_id({}, "job-7", one_node=False) == "job-7"
    # SLURM's job and the user's id win over the rendezvous id
    assert launch_run_id(SLURM, "5e1a-uuid", one_node=True) == "slurm-4242"
    assert launch_run_id({"DDPKIT_RUN_ID": "mine"}, "x", one_node=True) == "mine"
    with pytest.raises(ConfigError, match="DDPKIT_RUN_ID"):
        launch_run_id({"DDPKIT_RUN_ID": "a b"}, "x", one_node=True)
