"""Helpers the tests import, whichever folder they sit in (``from tests.support.x import ...``).

    distutil       run a test function in N processes forming a real gloo group
    example        examples/train.py's main() in ranks forked that way
    golden         compare a generated artifact with its golden file (DDPKIT_REGEN_GOLDEN=1)
    sbatch_parser  read ``#SBATCH`` lines back the way sbatch does
    slurm_cluster  the ``slurm`` fixture: the real SLURM test cluster of ``ci/slurm-up``
    sockets        which sockets listen where (read from /proc)

The one SLURM fake is :mod:`tests.fakes.slurm`; data files are in tests/data/ and
tests/golden/, scripts that tests run are in tests/scripts/.
"""
