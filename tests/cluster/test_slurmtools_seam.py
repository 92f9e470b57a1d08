"""Every SLURM command ddpkit runs goes through the one ``Runner`` seam of
:mod:`ddpkit.cluster.slurmtools`, and ``scontrol show config`` is asked in one place.

Read from the source (AST): a module outside ``cluster/slurmtools/`` that starts processes
(``subprocess``, ``os.system``/``exec*``/``spawn*``) or calls the real runner itself must not
name a SLURM tool; such a call would bypass the fakes tests hand in, the timeout and the
one error (``SchedulerError``) a missing or hanging tool becomes.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "ddpkit"
SEAM = PACKAGE / "cluster" / "slurmtools"
TOOLS = frozenset({"sbatch", "squeue", "sacct", "scontrol", "scancel", "srun", "salloc", "sinfo"})
_OS_SPAWNS = ("system", "popen", "exec", "spawn", "posix_spawn")


def _outside_seam() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if SEAM not in p.parents)


def _docstrings(tree: ast.AST) -> set[int]:
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }


def _is_command(value: object) -> bool:
    return isinstance(value, str) and value.split(" ", 1)[0] in TOOLS and " " in value.strip()


def _tool_commands(tree: ast.AST) -> list[str]:
    """SLURM commands the module spells out: a list or tuple whose first element is a tool
    (``["scontrol", "requeue", job]``), or a string that is a tool with arguments
    (``"scancel --signal=USR1 ..."``); docstrings aside, and a bare name like ``launch="srun"``
    (a launch mode, not a command) is not one."""
    skip = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.List | ast.Tuple) and node.elts:
            first = node.elts[0]
            if isinstance(first, ast.Constant) and first.value in TOOLS:
                found.append(ast.unparse(node))
        elif isinstance(node, ast.Constant) and _is_command(node.value) and id(node) not in skip:
            found.append(str(node.value))
    return found


def _starts_processes(tree: ast.AST) -> list[str]:
    """How the module starts processes itself: ``subprocess`` imported, ``os.system``/``exec*``/
    ``spawn*`` called, or the real runner ``subprocess_runner`` called (not merely passed)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name == "subprocess" for a in node.names):
            found.append(f"import subprocess (line {node.lineno})")
        elif isinstance(node, ast.ImportFrom) and node.module == "subprocess":
            found.append(f"from subprocess import ... (line {node.lineno})")
        elif isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            spawns = name.startswith("os.") and name[3:].startswith(_OS_SPAWNS)
            if spawns or name.rsplit(".", 1)[-1] == "subprocess_runner":
                found.append(f"{name}() (line {node.lineno})")
    return found


def seam_bypasses() -> dict[str, tuple[list[str], list[str]]]:
    """``{module: (how it starts processes, the SLURM tools it names)}`` for each bypass."""
    found = {}
    for path in _outside_seam():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        tools, starts = _tool_commands(tree), _starts_processes(tree)
        if tools and starts:
            found[str(path.relative_to(PACKAGE))] = (starts, tools)
    return found


def test_no_slurm_command_bypasses_the_runner_seam() -> None:
    assert seam_bypasses() == {}


def test_the_scan_catches_a_direct_call(tmp_path: Path) -> None:
    bad = ast.parse('import subprocess\nsubprocess.run(["scontrol", "requeue", "7"])\n')
    assert _starts_processes(bad) == ["import subprocess (line 1)"]
    assert _tool_commands(bad) == ["['scontrol', 'requeue', '7']"]
    runner = ast.parse('from x import subprocess_runner\nsubprocess_runner(("sbatch", "-p"))\n')
    assert _starts_processes(runner) and _tool_commands(runner)
    good = ast.parse('"""scontrol show job"""\nimport subprocess\nlaunch = "srun"\n')
    assert _starts_processes(good) and _tool_commands(good) == []


def _show_config_sites() -> list[str]:
    """Modules whose code holds the command ``scontrol show config`` as a list or tuple."""
    sites = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.List | ast.Tuple):
                words = [e.value for e in node.elts if isinstance(e, ast.Constant)]
                if words[:3] == ["scontrol", "show", "config"]:
                    sites.append(str(path.relative_to(PACKAGE)))
    return sites


def test_scontrol_show_config_is_asked_in_one_place() -> None:
    assert _show_config_sites() == ["cluster/slurmtools/config.py"]
