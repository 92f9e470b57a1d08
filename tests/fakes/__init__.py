"""Fakes shared by the tests (see tests/fakes/slurm.py): one per thing faked, never one per file."""
