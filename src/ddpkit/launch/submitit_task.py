"""The submitit task runner: the spec's command, run in each submitit task, with the stop
signal held and passed on (:mod:`ddpkit.cluster.stop.hold`, as each srun task of an sbatch job).

submitit's own handler would requeue the job from rank 0 behind the command's back; here the
command's guard agrees, saves and requeues, and a command that ended with code 0 after the
signal is not reported to submitit as finished (the requeued run will be). The command starts
with the signal blocked until ``ddpkit.init()`` latches it; one that handles the signal itself
must unblock it (``signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGUSR2])``).

The submitit backend pickles a :class:`RunCommand` per task and names this module by
``ddpkit.contract.SUBMITIT_TASK_MODULE`` (jobs/ imports nothing from launch/).
"""

from __future__ import annotations

import shlex
import subprocess

from ddpkit.cluster.stop.hold import run_holding

__all__ = ["RunCommand"]


class RunCommand:
    """Run a command in a submitit task, passing the stop signal on; picklable.

    The child inherits the task's stdout and stderr (nothing is buffered). A nonzero exit
    raises ``subprocess.CalledProcessError``, which submitit records as the job's error.
    """

    def __init__(
        self, command: list[str], *, cwd: str | None = None, env: dict[str, str] | None = None
    ) -> None:
        self.command = list(command)
        self.cwd = cwd
        self.env = dict(env or {})  # added to the task's environment (a sweep's variables)

    def __call__(self) -> int:
        print(f"ddpkit: running {shlex.join(self.command)}", flush=True)
        code, signalled = run_holding(self.command, cwd=self.cwd, env=self.env)
        if code != 0:
            raise subprocess.CalledProcessError(code, self.command)
        if signalled:
            # The guard requeued the job: no result for submitit now (SystemExit is not an
            # Exception there); the requeued run writes it.
            print("ddpkit: stopped after the stop signal; the requeued job continues", flush=True)
            raise SystemExit(0)
        return code
