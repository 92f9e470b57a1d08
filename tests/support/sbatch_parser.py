"""sbatch's own reading of a batch script's ``#SBATCH`` lines, in Python, for the tests.

A line-by-line port of SLURM 22.05.8's ``src/sbatch/opt.c`` (``next_line``, ``get_argument``,
``_opt_batch_script``): what ``sbatch`` hands to its option parser, so a test can check that a
generated line means exactly the options it was written for. The rules that matter:

* lines are read until the first one that is neither empty nor a comment;
* a backslash escapes the next character everywhere, inside quotes too, and is dropped;
* ``'`` and ``"`` group (whitespace included) and are dropped; unquoted whitespace separates;
* an unquoted ``#`` ends the line; a line break cannot be inside a value at all;
* an unmatched quote or an argument starting with ``:`` is fatal (sbatch exits);
* ``hetjob`` (or ``packjob``) as a word at the start of an argument ends the line; at the
  start of a line it separates het components.
"""

from __future__ import annotations

__all__ = ["HETJOB", "SbatchFatal", "directive_arguments"]

HETJOB = "<hetjob separator>"
_SPACE = " \t\n\v\f\r"  # C's isspace() in the C locale
_SEPARATORS = ("packjob", "hetjob")


class SbatchFatal(ValueError):
    """What makes sbatch itself exit: ``fatal("...: line N: Unmatched ...")``."""


def _separator(line: str, pos: int) -> int | None:
    """The end of a het separator word at ``pos`` (sbatch blanks it), or None."""
    for word in _SEPARATORS:
        end = pos + len(word)
        if line[pos:end].lower() == word and (end == len(line) or line[end] in _SPACE):
            return end
    return None


def _argument(line: str, pos: int) -> tuple[str | None, int, bool]:
    """``get_argument``: (the argument or None, where the scan stopped, a separator seen)."""
    while pos < len(line) and line[pos] in _SPACE:
        pos += 1
    end = _separator(line, pos)
    if end is not None:
        return None, end, True
    if pos < len(line) and line[pos] == ":":
        raise SbatchFatal(f"Unexpected `:` in [{line}]")
    chars: list[str] = []
    found = False  # C: argument stays NULL until a character is copied
    quote = ""
    escape = False
    while pos < len(line) and (quote or line[pos] not in _SPACE):
        char = line[pos]
        if escape:
            escape = False
        elif char == "\\":
            escape = True
            pos += 1
            continue
        elif quote:
            if char == quote:
                quote = ""
                pos += 1
                continue
        elif char in "\"'":
            quote = char
            pos += 1
            continue
        elif char == "#":
            break
        chars.append(char)
        found = True
        pos += 1
    if quote:
        raise SbatchFatal(f"Unmatched `{quote}` in [{line}]")
    return ("".join(chars) if found else None), pos, False


def _line_arguments(rest: str) -> list[str]:
    out: list[str] = []
    pos = 0
    while True:
        argument, pos, separator = _argument(rest, pos)
        if separator:
            # sbatch blanks the word and then finds no argument there: the line ends; only
            # at the start of a line does it separate het components
            return out or [HETJOB]
        if argument is None:
            return out
        out.append(argument)


def directive_arguments(script: str) -> list[str]:
    """The arguments sbatch reads from ``script``'s ``#SBATCH``/``#SLURM`` lines, in order
    (:data:`HETJOB` where a het component ends)."""
    arguments: list[str] = []
    for line in script.split("\n"):
        if line.startswith("#SBATCH"):
            rest = line[len("#SBATCH") :]
        elif line.startswith("#SLURM"):
            rest = line[len("#SLURM") :]
        else:
            text = line.lstrip(_SPACE)
            if text and not text.startswith("#"):
                break  # the first command ends the directives
            continue
        arguments += _line_arguments(rest)
    return arguments
