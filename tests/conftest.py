"""Suite-wide guards: a test must leave no environment variable and no process group behind.

The tests mirror the source tree (tests/cluster/ for ddpkit/cluster/, ...; the bottom modules
and cross-cutting checks at the top). ``tests`` is a package, so its helpers are imported as
``tests.support.*`` (golden files, spawned gloo workers, the real SLURM test cluster) and
``tests.fakes.slurm`` (the one SLURM fake), whichever folder a test sits in.
"""

from __future__ import annotations

import getpass
import os
import sys
import tempfile
from collections.abc import Iterator

import pytest

# the fixtures of the SLURM tests (every file using them ends in _cluster.py: test_architecture)
from tests.support.slurm_cluster import slurm, slurm_cluster  # noqa: F401

# pytest itself rewrites this one between a test's phases
_PYTEST_OWN = {"PYTEST_CURRENT_TEST"}


def _environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _PYTEST_OWN}


# torch's inductor writes this one into os.environ whenever it looks its cache folder up
# (torch/_inductor/runtime/cache_dir_utils.py: cache_dir(), at every compile, not only the first):
# set once for the whole session, to the absolute path it would write, so that a compile in any
# test, in any order, changes nothing (a per-test exception for the first import of
# torch._dynamo missed later compiles once the test order changed)
_INDUCTOR_CACHE_VAR = "TORCHINDUCTOR_CACHE_DIR"
os.environ.setdefault(
    _INDUCTOR_CACHE_VAR,
    os.path.abspath(os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")),
)


@pytest.fixture(autouse=True)
def _no_env_leak() -> Iterator[None]:
    before = _environ()
    yield
    after = _environ()
    if after != before:
        added = sorted(set(after) - set(before))
        removed = sorted(set(before) - set(after))
        changed = sorted(k for k in set(after) & set(before) if after[k] != before[k])
        for key in added:
            del os.environ[key]
        os.environ.update({k: before[k] for k in removed + changed})
        pytest.fail(
            f"test leaked environment changes: added={added} removed={removed} changed={changed}"
        )


@pytest.fixture(autouse=True)
def _no_process_group_leak() -> Iterator[None]:
    yield
    dist_mod = sys.modules.get("torch.distributed")
    if dist_mod is not None and dist_mod.is_available() and dist_mod.is_initialized():
        dist_mod.destroy_process_group()
        pytest.fail("test leaked an initialized torch.distributed process group")
