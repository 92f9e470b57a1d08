"""A progress bar for the main rank: ``for x, y in ddpkit.progress(train): ...``.

Only the main rank draws (every rank drawing garbles the terminal they share); the others
iterate silently. The bar is also silent when its stream is not a terminal, so logs stay as
they were, unless ``enabled=True`` or ``DDPKIT_PROGRESS=1`` (then one line per ``every_s``);
``enabled=False`` or ``DDPKIT_PROGRESS=0`` turn it off. Over a
:class:`~ddpkit.worker.loader.DistributedLoader` a resumed pass starts at its saved position.
No tqdm needed; importing this module does not import torch.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from typing import IO, Generic, TypeVar

from ddpkit.cluster.envvars import env_bool
from ddpkit.contract import PROGRESS_VAR
from ddpkit.errors import ConfigError
from ddpkit.worker.rankzero import _rank

__all__ = ["PROGRESS_VAR", "Progress", "progress"]

_FILE_EVERY_S = 10.0  # a file gets a full line this often (a terminal is redrawn in place)

T = TypeVar("T")


def wanted(enabled: bool | None, stream: IO[str], rank: int, environ: Mapping[str, str]) -> bool:
    """Whether a bar is drawn: main rank only; the argument, else the variable, else a tty."""
    if rank != 0:
        return False
    hint = f"{PROGRESS_VAR}=0 turns the progress bar off, =1 draws it even into a file"
    choice = env_bool(environ, PROGRESS_VAR, hint=hint) if enabled is None else enabled
    return _isatty(stream) if choice is None else choice


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


def _duration(seconds: float) -> str:
    whole = max(0, int(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


def render(
    desc: str, done: int, total: int | None, *, rate: float, elapsed_s: float, width: int
) -> str:
    """One line: ``desc  42%|#####     | 42/100 [00:03<00:04, 12.3 it/s]``, at most ``width``."""
    head = f"{desc}: " if desc else ""
    speed = f"{rate:.1f} it/s" if rate > 0 else "? it/s"
    if total is None:
        return f"{head}{done} [{_duration(elapsed_s)}, {speed}]"[:width]
    eta = _duration((total - done) / rate) if rate > 0 else "?"
    tail = f" {done}/{total} [{_duration(elapsed_s)}<{eta}, {speed}]"
    percent = f"{100 * done // total if total else 100:3d}%|"
    room = width - len(head) - len(percent) - len(tail) - 1
    if room < 5:  # a narrow terminal: the numbers matter more than the bar
        return f"{head}{percent[:-1]}{tail}"[:width]
    filled = room * done // total if total else room
    return f"{head}{percent}{'#' * filled}{' ' * (room - filled)}|{tail}"


class Progress(Generic[T]):
    """Iterates ``iterable`` and draws its progress on the main rank (see the module doc).

    ``n`` is the position (including a resumed pass's skipped batches) and ``total`` the
    pass's length; both are known once iteration has started.
    """

    def __init__(
        self,
        iterable: Iterable[T],
        *,
        total: int | None,
        desc: str,
        enabled: bool | None,
        stream: IO[str] | None,
        every_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._iterable = iterable
        self._stream = sys.stderr if stream is None else stream
        self._draw = wanted(enabled, self._stream, _rank(), os.environ)
        self._tty = self._draw and _isatty(self._stream)
        self._every_s = every_s if self._tty else max(every_s, _FILE_EVERY_S)
        self._clock = clock
        self.desc = desc
        self.total = total
        self.n = 0
        self._start_n = 0
        self._started = 0.0
        self._drawn_at: float | None = None

    def __len__(self) -> int:
        if self.total is None:
            raise TypeError("this progress bar has no known length")
        return self.total

    def __iter__(self) -> Iterator[T]:
        inner = iter(self._iterable)
        self._start_at(inner)
        try:
            for item in inner:
                yield item
                self.n += 1
                self._maybe_draw(final=False)
        finally:
            self._maybe_draw(final=True)

    def _start_at(self, inner: Iterator[T]) -> None:
        """Position and length from a loader's pass (which knows a resumed start), else 0/len."""
        step = getattr(inner, "step", None)  # a DistributedLoader pass: its last step, first-1
        if isinstance(step, int) and isinstance(inner, Sized):
            self.n = self._start_n = step + 1
            if self.total is None:
                self.total = self.n + len(inner)
        elif self.total is None and isinstance(self._iterable, Sized):
            self.total = len(self._iterable)
        self._started = self._clock()
        self._maybe_draw(final=False, now=self._started)

    def _maybe_draw(self, *, final: bool, now: float | None = None) -> None:
        if not self._draw:
            return
        now = self._clock() if now is None else now
        if not final and self._drawn_at is not None and now - self._drawn_at < self._every_s:
            return
        self._drawn_at = now
        elapsed = now - self._started
        rate = (self.n - self._start_n) / elapsed if elapsed > 0 else 0.0
        width = shutil.get_terminal_size((100, 24)).columns - 1
        line = render(self.desc, self.n, self.total, rate=rate, elapsed_s=elapsed, width=width)
        if self._tty:
            end = "\n" if final else ""
            self._stream.write(f"\r{line}\x1b[K{end}")  # \x1b[K: clear what a longer line left
        else:
            self._stream.write(line + "\n")
        self._stream.flush()


def progress(
    iterable: Iterable[T],
    desc: str = "",
    *,
    total: int | None = None,
    enabled: bool | None = None,
    file: IO[str] | None = None,
    every_s: float = 0.1,
) -> Progress[T]:
    """Wrap ``iterable`` (e.g. a ``ddpkit.loader``) in a progress bar drawn on the main rank.

    The bar shows position/total, rate, elapsed time and ETA on ``file`` (stderr), redrawn at
    most every ``every_s`` seconds. ``enabled``: None (the default) draws when
    ``DDPKIT_PROGRESS`` says so, else when ``file`` is a terminal; False never; True always
    (on the main rank). Other ranks never draw. ``total`` overrides the length.
    """
    if isinstance(enabled, str) or (enabled is not None and not isinstance(enabled, bool)):
        raise ConfigError(
            f"enabled={enabled!r} is not True, False or None",
            hint="None draws when stderr is a terminal; False turns the bar off",
        )
    if not isinstance(every_s, int | float) or every_s < 0:
        raise ConfigError(f"every_s={every_s!r} must be a non-negative number", hint="e.g. 0.1")
    return Progress(iterable, total=total, desc=desc, enabled=enabled, stream=file, every_s=every_s)
