"""Workers die with their launcher, whatever kills it (Linux): a parent-death signal, a sweeper.

torch's agent starts workers in sessions of their own; a SIGKILL (or OOM kill) of the
launcher left them training to the end, writing checkpoints that raced a restarted run.
:func:`tied` sets up two things around one launch:

* Each worker asks for SIGKILL when the thread that started it exits
  (``prctl(PR_SET_PDEATHSIG)``, kept across ``exec``): a script, ``-m`` or ``--no-python``
  worker starts as ``python -I -S -c STUB <launcher pid> <command...>``, which sets it,
  checks that the launcher is still its parent, and ``exec``s the command (same pid); a
  ``--run-path`` worker does the same in its entry function.
* A sweeper (``python -I -S -c SWEEPER``, its own session, deaf to the usual signals) waits
  for the launcher to close a pipe; an end of file without ``done`` means the launcher died,
  and it SIGKILLs every process whose environment holds this launch's :data:`TOKEN_VAR`: what
  the workers started themselves, which no parent-death signal reaches.

SIGKILL, not SIGTERM: a worker may ignore or handle SIGTERM, and with the launcher gone nobody
waits for anything. Elsewhere than on Linux neither exists.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

from ddpkit.cluster.stop import forward as relay
from ddpkit.contract import LAUNCH_TOKEN_VAR as TOKEN_VAR

__all__ = ["STUB", "SUPPORTED", "SWEEPER", "TOKEN_VAR", "tie", "tie_to", "tied"]

SUPPORTED = sys.platform.startswith("linux")
_PR_SET_PDEATHSIG = 1
_DONE = b"done"
_SWEEPER_EXIT_S = 5.0

# The standard library only, under -I -S: no site, no PYTHONPATH, no current directory on
# sys.path, so nothing of the user's (nor a stray ctypes.py) is imported before the exec.
STUB = """\
# ddpkit: this worker dies with its launcher (prctl PR_SET_PDEATHSIG), then runs its command
import ctypes, os, signal, sys
launcher, command = int(sys.argv[1]), sys.argv[2:]
prctl = ctypes.CDLL(None, use_errno=True).prctl
zero = ctypes.c_ulong(0)
if prctl(ctypes.c_int(1), ctypes.c_ulong(signal.SIGKILL), zero, zero, zero) != 0:
    print(f"ddpkit: prctl(PR_SET_PDEATHSIG): {os.strerror(ctypes.get_errno())}: this worker"
          " will outlive a launcher killed by SIGKILL", file=sys.stderr, flush=True)
if os.getppid() != launcher:
    print(f"ddpkit: the launcher (pid {launcher}) is gone before this worker started:"
          " not starting", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
try:
    os.execvp(command[0], command)
except OSError as exc:
    print(f"ddpkit: cannot run {command[0]!r}: {exc.strerror}", file=sys.stderr, flush=True)
    os._exit(127)
"""

SWEEPER = """\
# ddpkit: when the launcher dies, kill what its workers left (see ddpkit.launch.deathsig)
import os, signal, sys, time
for name in ("INT", "TERM", "HUP", "QUIT", "USR1", "USR2", "PIPE", "ALRM", "XCPU", "XFSZ",
             "VTALRM", "PROF", "IO", "PWR"):  # whatever a stop signal forwarded to children is
    if hasattr(signal, "SIG" + name):
        signal.signal(getattr(signal, "SIG" + name), signal.SIG_IGN)
launcher, mark = sys.argv[1], sys.argv[2].encode()
if sys.stdin.buffer.read() == b"done":
    sys.exit(0)
killed = set()
for _ in range(100):  # bounded: a process that forks as fast as it is killed ends the loop
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/environ", "rb") as environ:  # empty for a zombie
                if entry != str(os.getpid()) and mark in environ.read().split(b"\\0"):
                    found.append(int(entry))
        except (OSError, ValueError):  # not a process, gone, or not ours to read
            pass
    if not found:
        break
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
            killed.add(pid)
        except OSError:
            pass
    time.sleep(0.02)
if killed:
    print(f"ddpkit: the launcher (pid {launcher}) died; killed the {len(killed)} processes"
          f" of its run still running: {sorted(killed)}", file=sys.stderr, flush=True)
"""


def tie(
    entrypoint: str | Callable[..., Any], args: tuple[str, ...], launcher: int | None = None
) -> tuple[str | Callable[..., Any], tuple[str, ...]]:
    """The (entrypoint, args) to hand torch's agent so that each worker dies with ``launcher``
    (default: this process); unchanged where that cannot be done (not Linux)."""
    launcher = os.getpid() if launcher is None else launcher
    if not SUPPORTED:
        return entrypoint, args
    if isinstance(entrypoint, str):
        return sys.executable, ("-I", "-S", "-c", STUB, str(launcher), entrypoint, *args)
    return _Tied(entrypoint, launcher), args


class _Tied:
    """A ``--run-path`` entry function that first ties its process to the launcher.

    A class, not a closure: ``spawn`` pickles it; torch names the run by ``__name__``."""

    def __init__(self, function: Callable[..., Any], launcher: int) -> None:
        self.function = function
        self.launcher = launcher
        self.__name__ = getattr(function, "__name__", "entrypoint")
        self.__qualname__ = getattr(function, "__qualname__", self.__name__)

    def __call__(self, *args: Any) -> Any:
        tie_to(self.launcher)
        return self.function(*args)


def tie_to(launcher: int) -> None:
    """In a worker: SIGKILL when the parent thread exits; die now if ``launcher`` is gone.

    The parent is the launcher, or the forkserver it started (which exits once the launcher is
    gone): so "gone" is "the parent is not the launcher, and the launcher does not exist"."""
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    zero = ctypes.c_ulong(0)
    prctl(ctypes.c_int(_PR_SET_PDEATHSIG), ctypes.c_ulong(signal.SIGKILL), zero, zero, zero)
    if os.getppid() != launcher:
        try:
            os.kill(launcher, 0)
        except ProcessLookupError:
            os.kill(os.getpid(), signal.SIGKILL)
        except PermissionError:
            pass


@contextmanager
def tied() -> Iterator[str | None]:
    """Around one launch: start the sweeper; yields the token to put in ``os.environ`` (under
    :data:`TOKEN_VAR`) before the workers start, or None where there is no sweeper."""
    if not SUPPORTED:
        yield None
        return
    token = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k != TOKEN_VAR}
    command = [sys.executable, "-I", "-S", "-c", SWEEPER, str(os.getpid()), f"{TOKEN_VAR}={token}"]
    try:
        with relay.not_a_worker() as record:
            sweeper = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # a signal to the launcher's process group spares it
            )
            record(sweeper.pid)
    except OSError:  # no sweeper: the parent-death signal still stops the workers themselves
        yield token
        return
    try:
        yield token
    finally:
        _dismiss(sweeper)
        relay.forget(sweeper.pid)


def _dismiss(sweeper: subprocess.Popen[bytes]) -> None:
    """Tell the sweeper the workers have ended (nothing to sweep), and reap it."""
    assert sweeper.stdin is not None
    with suppress(OSError):
        sweeper.stdin.write(_DONE)
    with suppress(OSError):
        sweeper.stdin.close()
    try:
        sweeper.wait(timeout=_SWEEPER_EXIT_S)
    except subprocess.TimeoutExpired:
        sweeper.kill()
        sweeper.wait()
