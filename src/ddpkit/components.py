"""ddpkit's torchx components: DDP training as a building block for pipelines.

Registered under the ``torchx.components`` entry point ``ddpkit`` (so ``torchx builtins`` lists
``ddpkit.ddp`` beside torchx's own ``dist.ddp``, ``utils.echo``, ...)::

    torchx run -s local_cwd ddpkit.ddp -j 1x2 --script train.py --lr 0.1
    torchx run -s slurm -cfg partition=debug ddpkit.ddp -j 2x1 -m pkg.train
    torchx run -s local_cwd ddpkit.ddp --spec job.yaml       # a ddpkit job spec file

Importing this module needs torchx (``pip install ddpkit[torchx]``). Every function here is a
component: torchx lists all functions of the module, so helpers live in
``ddpkit.jobs.backends.torchx_appdef``, which also holds the one spec -> AppDef conversion.

The signatures are written for torchx, not for modern typing: torchx's component linter
(``torchx.specs.file_linter``) reads the annotations from the source and only accepts names,
``Optional[...]``, ``Dict[...]`` and ``List[...]``, and its argument parser reads them at run
time, so this module must not use ``from __future__ import annotations`` either.
"""

# ruff: noqa: UP006, UP035, UP045  (torchx's linter needs typing.Optional/Dict, see above)

from typing import Dict, Optional

from torchx import specs  # type: ignore[import-untyped]

from ddpkit.errors import ConfigError
from ddpkit.jobs.backends import torchx_appdef

__all__ = ["ddp"]


def ddp(
    *script_args: str,
    script: Optional[str] = None,
    m: Optional[str] = None,
    j: str = "1x2",
    name: str = "ddpkit",
    cpu: int = 1,
    gpu: int = 0,
    memMB: int = 1024,
    h: Optional[str] = None,
    env: Optional[Dict[str, str]] = None,
    max_retries: int = 0,
    rdzv_port: int = 0,
    spec: Optional[str] = None,
    python: str = "python",
) -> specs.AppDef:
    """DDP training with ddpkit: one replica per node, each runs python -m ddpkit run.

    Every worker finds its rank with ddpkit.init() (launcher torchrun). One node uses a
    free local port; several nodes meet at a c10d rendezvous on rank 0's host (the scheduler
    names it: localhost on local_cwd, the first node on slurm). Give a script or a module, or a
    ddpkit job spec file with --spec (then the spec alone describes the job).

    Args:
        script_args: arguments passed to the script or module
        script: the training script to run, e.g. train.py
        m: the module to run instead of a script, e.g. pkg.train
        j: NODESxPROCS: nodes x processes per node, e.g. 2x4; a bare number is one node
        name: the job name
        cpu: CPUs per node (for all its processes)
        gpu: GPUs per node
        memMB: memory per node in MB
        h: a torchx named resource; replaces cpu, gpu and memMB
        env: environment variables for the job, e.g. A=1,B=2
        max_retries: how many times the scheduler may restart the job
        rdzv_port: rendezvous port on rank 0's host (several nodes only); 0 derives it from
            the job id, so two jobs sharing a node do not collide
        spec: a ddpkit job spec file (YAML); excludes script, m and the other job flags
        python: the Python interpreter on the nodes
    """
    if spec is not None:
        if script is not None or m is not None or script_args:
            raise ConfigError(
                f"spec={spec!r} given together with a script, module or arguments",
                hint="a job spec names its own command; drop --script/-m and the arguments",
            )
        from ddpkit.jobs.load import load_spec

        return torchx_appdef.spec_to_appdef(load_spec(spec))
    if (script is None) == (m is None):
        raise ConfigError(
            f"script={script!r}, m={m!r}: give exactly one",
            hint="--script train.py to run a script, or -m pkg.train to run a module",
        )
    nodes, procs = torchx_appdef.parse_j(j)
    command = [script] if script is not None else ["-m", str(m)]
    return torchx_appdef.ddp_appdef(
        name=name,
        command=[*command, *script_args],
        nodes=nodes,
        procs=procs,
        python=python,
        cpu=cpu,
        gpu=gpu,
        mem_mb=memMB,
        h=h,
        env=env,
        max_retries=max_retries,
        rdzv_port=rdzv_port or None,
    )
