"""The house plan, checked: module-level imports form no cycle, and backends sit behind one
protocol found through one registry."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from ddpkit.errors import ConfigError
from ddpkit.jobs.backends import BACKENDS, Backend, get_backend

SRC = Path(__file__).resolve().parents[1] / "src"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of ``path`` that runs: at module level or lazily inside a function
    (a lazy import is a dependency all the same), not under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    guarded = {
        id(child)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.body
        for child in ast.walk(stmt)
    }
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom) and id(node) not in guarded
    ]


def _runtime_imports(path: Path, package: str) -> set[str]:
    """The ddpkit modules ``path`` imports (see :func:`_imports`)."""
    found: set[str] = set()
    for node in _imports(path):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("ddpkit"))
        elif node.module:
            base = node.module
            if node.level:  # relative: resolve against this package
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}"
            if base.startswith("ddpkit"):
                found.add(base)
                found.update(f"{base}.{a.name}" for a in node.names)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in SRC.joinpath("ddpkit").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        # a module's own parent packages are being imported already: no edge to them
        parents = {name.rsplit(".", k)[0] for k in range(1, name.count(".") + 1)}
        graph[name] = {
            m for m in _runtime_imports(path, package) if m in files and m != name
        } - parents
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle_among_ddpkit_modules() -> None:
    graph = import_graph()
    assert len(graph) > 40  # the walk found the package
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("via", sorted(BACKENDS))
def test_every_backend_implements_the_protocol(via: str) -> None:
    if via in ("submitit", "torchx"):
        pytest.importorskip(via)  # optional extras; the dev extra installs both
    backend = get_backend(via)
    assert backend.via == via
    for name, member in inspect.getmembers(Backend, inspect.isfunction):
        if not name.startswith("_"):
            ours = getattr(backend, name)
            assert (
                list(inspect.signature(ours).parameters)
                == list(inspect.signature(member).parameters)[1:]
            ), name  # same arguments as the protocol (self aside)


def test_unknown_backend_is_a_config_error_with_did_you_mean() -> None:
    expected = r"via 'submitt' is not a backend.*did you mean 'submitit'"
    with pytest.raises(ConfigError, match=expected):
        get_backend("submitt")


def _imports_of(path: Path) -> set[str]:
    """Top-level names of every module ``path`` imports (see :func:`_imports`)."""
    names: set[str] = set()
    for node in _imports(path):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_cluster_package_never_imports_torch() -> None:
    """cluster/ answers "who and where am I" from a snapshot of the environment: no torch, so
    the launcher, the job tools and `ddpkit --help` stay light."""
    offenders = [
        str(p.relative_to(SRC))
        for p in SRC.joinpath("ddpkit", "cluster").rglob("*.py")
        if "torch" in _imports_of(p)
    ]
    assert offenders == []


def test_no_source_file_over_500_lines() -> None:
    sizes = {
        str(p.relative_to(SRC)): len(p.read_text(encoding="utf-8").splitlines())
        for p in SRC.joinpath("ddpkit").rglob("*.py")
    }
    assert {name: n for name, n in sizes.items() if n > 500} == {}
