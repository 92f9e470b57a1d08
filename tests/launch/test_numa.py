"""``ddpkit run --numa-binding``: torchrun's flag of the same name, passed to torch's own parser
(the workers are bound by torch's agent, near their GPUs)."""

from __future__ import annotations

import pytest
import torch.distributed.run as torch_run

from ddpkit.cli.run import config_from_argv
from ddpkit.errors import ConfigError
from ddpkit.launch.local import build_launch_config

WORKER = "tests/scripts/env_worker.py"


def test_the_flag_and_its_pet_variable_reach_torchs_launch_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("torch.numa.binding", reason="torch before 2.9 has no --numa-binding")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # else torch's config_from_args writes it
    argv = ["--nproc-per-node", "2", "--numa-binding", "socket", WORKER]
    config = config_from_argv(argv, {})
    assert config.numa_binding == "socket"
    assert "--numa-binding=socket" in config.torchrun_command()  # what --dry-run prints
    ours = build_launch_config(config).launch_config
    theirs = torch_run.config_from_args(torch_run.parse_args(argv))[0]
    assert ours.numa_options == theirs.numa_options and ours.numa_options is not None
    pet = config_from_argv(["--nproc-per-node", "2", WORKER], {"PET_NUMA_BINDING": "node"})
    assert pet.numa_binding == "node"
    plain = config_from_argv(["--nproc-per-node", "2", WORKER], {})
    assert plain.numa_binding is None and "--numa-binding" not in plain.torchrun_command()
    assert build_launch_config(plain).launch_config.numa_options is None


def test_a_mode_torch_does_not_have_is_refused_with_a_suggestion() -> None:
    with pytest.raises(ConfigError) as info:
        config_from_argv(["--numa-binding", "sockets", WORKER], {})
    assert "--numa-binding='sockets' is not supported" in str(info.value)
    assert "socket" in str(info.value.hint)
