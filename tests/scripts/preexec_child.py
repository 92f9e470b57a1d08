"""For tests/cluster/stop/test_forward_exec.py: a catching-only relay and one child held
between its fork and its exec, as CPython's ``_posixsubprocess`` leaves a vfork child: every
signal blocked and this process's handlers, then the default actions, the old mask and exec.

Usage: ``preexec_child.py THEN WHEN``. THEN: what the child execs, ``plain`` (never handles
SIGUSR2) or ``catch`` (handles it; waits up to 5 s for it). WHEN: the moment the stop signal
comes to this process: ``before`` the fork, ``early`` or ``late`` in the child's 0.6 s window,
or ``exec`` (the child has exec'd and does not catch it yet). Prints what the child printed
(``none`` or ``got``) and how it ended (``exit N`` or ``signal NAME``).
"""

from __future__ import annotations

import os
import signal
import sys
import time

from ddpkit.cluster.stop import forward

WINDOW_S = 0.6
AT = {"early": 0.05, "late": 0.5, "exec": WINDOW_S + 0.15}
CHILD = {
    "plain": "import time; time.sleep(0.3); print('none', flush=True)",
    "catch": (
        "import signal, time\n"
        "got = []\n"
        "signal.signal(signal.SIGUSR2, lambda *a: got.append(1))\n"
        "deadline = time.monotonic() + 5.0\n"
        "while not got and time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n"
        "print('got' if got else 'none', flush=True)\n"
    ),
}

if __name__ == "__main__":
    then, when = sys.argv[1], sys.argv[2]
    stop = signal.SIGUSR2
    forward.block(stop)
    forward.start(stop, catching_only=True)
    forward.release(stop)
    if when == "before":
        os.kill(os.getpid(), stop)
        time.sleep(0.1)
    old = signal.pthread_sigmask(signal.SIG_BLOCK, set(signal.valid_signals()))
    pid = os.fork()
    if pid == 0:  # the window: the relay looks (and used to send) meanwhile
        time.sleep(WINDOW_S)
        signal.signal(stop, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
        os.execv(sys.executable, [sys.executable, "-c", CHILD[then]])
    signal.pthread_sigmask(signal.SIG_SETMASK, old)
    if when in AT:
        time.sleep(AT[when])
        os.kill(os.getpid(), stop)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        print("signal", signal.Signals(os.WTERMSIG(status)).name, flush=True)
    else:
        print("exit", os.WEXITSTATUS(status), flush=True)
