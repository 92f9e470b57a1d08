"""DDPKIT_EXPECTED_WORLD_SIZE: detect() holds the launcher to the world size a job asked for."""

from __future__ import annotations

import pytest

from ddpkit.cluster import validate
from ddpkit.cluster.detect import detect
from ddpkit.errors import ConfigError, TopologyError
from tests.cluster.test_env_slurm import BATCH_ENV, srun_env
from tests.cluster.test_env_submitit import local_env
from tests.cluster.test_env_torchrun import torchrun_env

BATCH_HINT = (
    "the job spec says launch: srun — start the tasks with srun (the generated script does), "
    "not `python` directly in the batch script"
)


def expect(size: int | str, launch: str | None = "srun") -> dict[str, str]:
    """The variables a generated job script exports for a spec of ``size`` processes."""
    extra = {"DDPKIT_EXPECTED_WORLD_SIZE": str(size)}
    return extra if launch is None else extra | {"DDPKIT_JOB_LAUNCH": launch}


# ---- the pure check --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expected", "world_size", "launcher", "job_launch"),
    [
        (4, 4, "slurm", "srun"),
        (8, 8, "torchrun", "torchrun"),
        (1, 1, "single", "srun"),
        (2, 2, "submitit", None),
    ],
)
def test_matching_world_sizes_pass(
    expected: int, world_size: int, launcher: str, job_launch: str | None
) -> None:
    validate.check_expected_world_size(
        expected=expected, world_size=world_size, launcher=launcher, job_launch=job_launch
    )


@pytest.mark.parametrize(
    ("sizes", "launcher", "job_launch", "message", "hint"),
    [
        (
            (4, 1),
            "single",
            "srun",
            "DDPKIT_EXPECTED_WORLD_SIZE=4, DDPKIT_JOB_LAUNCH=srun but the single launcher "
            "started a world of 1 process",
            BATCH_HINT,
        ),
        (
            (8, 2),
            "slurm",
            "torchrun",
            "DDPKIT_EXPECTED_WORLD_SIZE=8, DDPKIT_JOB_LAUNCH=torchrun but the slurm launcher "
            "started a world of 2 processes",
            "through `python -m ddpkit run`",
        ),
        (
            (8, 1),
            "single",
            "torchrun",
            "DDPKIT_EXPECTED_WORLD_SIZE=8, DDPKIT_JOB_LAUNCH=torchrun but the single launcher "
            "started a world of 1 process",
            "launch: torchrun",
        ),
        (
            (4, 2),
            "slurm",
            "srun",
            "DDPKIT_EXPECTED_WORLD_SIZE=4, DDPKIT_JOB_LAUNCH=srun but the slurm launcher "
            "started a world of 2 processes",
            "unset DDPKIT_EXPECTED_WORLD_SIZE",
        ),
        (
            (2, 4),
            "mpi",
            None,
            "DDPKIT_EXPECTED_WORLD_SIZE=2 but the mpi launcher started a world of 4 processes",
            "nodes × procs_per_node",
        ),
    ],
)
def test_mismatches_name_both_sizes_the_launcher_and_a_hint(
    sizes: tuple[int, int], launcher: str, job_launch: str | None, message: str, hint: str
) -> None:
    expected, world_size = sizes
    with pytest.raises(TopologyError) as caught:
        validate.check_expected_world_size(
            expected=expected, world_size=world_size, launcher=launcher, job_launch=job_launch
        )
    assert caught.value.message == message
    assert caught.value.hint is not None
    assert hint in caught.value.hint


# ---- through detect() ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "env",
    [
        *(srun_env(rank) | expect(4) for rank in range(4)),
        *(torchrun_env(rank) | expect(8, "torchrun") for rank in range(8)),
        # torchrun workers inside a SLURM step (one srun task per node): torchrun's view counts.
        srun_env(1, (1, 1), tasks_per_node="1(x2)") | torchrun_env(5, 4, 2) | expect(8, "torchrun"),
        local_env(1) | expect(2, None),
        {"PATH": "/usr/bin"} | expect(1),
    ],
)
def test_detect_passes_when_the_world_matches(env: dict[str, str]) -> None:
    assert detect(env).world_size == int(env["DDPKIT_EXPECTED_WORLD_SIZE"])


def test_batch_script_without_srun_is_caught_with_the_hint() -> None:
    with pytest.raises(TopologyError) as caught:
        detect(BATCH_ENV | expect(4))
    assert "DDPKIT_EXPECTED_WORLD_SIZE=4" in caught.value.message
    assert "single launcher started a world of 1 process" in caught.value.message
    assert caught.value.hint == BATCH_HINT


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        # srun started fewer tasks than the spec asked for (e.g. an edited --ntasks).
        (srun_env(0) | expect(8), "slurm launcher started a world of 4 processes"),
        # torchrun mode, but the node's task ran the script itself instead of `ddpkit run`.
        (
            srun_env(0, (1, 1), tasks_per_node="1(x2)") | expect(8, "torchrun"),
            "slurm launcher started a world of 2 processes",
        ),
        (torchrun_env(0, 2, 2) | expect(8, "torchrun"), "torchrun launcher started a world of 4"),
        ({} | expect(2), "single launcher started a world of 1 process"),
    ],
)
def test_detect_raises_on_other_mismatches(env: dict[str, str], fragment: str) -> None:
    with pytest.raises(TopologyError, match="DDPKIT_EXPECTED_WORLD_SIZE=") as caught:
        detect(env)
    assert fragment in caught.value.message
    assert caught.value.hint


def test_without_the_variable_nothing_is_checked() -> None:
    info = detect(BATCH_ENV | {"DDPKIT_JOB_LAUNCH": "srun"})
    assert (info.launcher, info.world_size) == ("single", 1)


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("four", "DDPKIT_EXPECTED_WORLD_SIZE='four' is not an integer"),
        ("", "DDPKIT_EXPECTED_WORLD_SIZE='' is not an integer"),
        ("0", "DDPKIT_EXPECTED_WORLD_SIZE=0 must be at least 1"),
        ("-2", "DDPKIT_EXPECTED_WORLD_SIZE=-2 must be at least 1"),
    ],
)
def test_a_bad_value_is_a_config_error(value: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        detect(srun_env(0) | {"DDPKIT_EXPECTED_WORLD_SIZE": value})
    assert fragment in str(caught.value)
    assert caught.value.hint


def test_default_environment_is_checked_too(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (BATCH_ENV | expect(4)).items():
        monkeypatch.setenv(name, value)
    for name in ("SLURM_STEP_ID", "SLURM_STEPID", "RANK", "WORLD_SIZE", "SUBMITIT_EXECUTOR"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(TopologyError, match="start the tasks with srun"):
        detect()
