"""The house plan, checked: the layers import only downwards (the allowed-imports table), imports
form no cycle, backends sit behind one protocol found through one registry, and the tests'
real-cluster files are recognisable by name."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from ddpkit.errors import ConfigError
from ddpkit.jobs.backends import BACKENDS, Backend, get_backend
from tests.support import needs

SRC = Path(__file__).resolve().parents[1] / "src"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, *, type_checking: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of ``path`` that runs: at module level or lazily inside a function
    (a lazy import is a dependency all the same); those under ``if TYPE_CHECKING:`` too when
    ``type_checking``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    guarded = (
        set()
        if type_checking
        else {
            id(child)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for stmt in node.body
            for child in ast.walk(stmt)
        }
    )
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom) and id(node) not in guarded
    ]


def _runtime_imports(path: Path, package: str, *, type_checking: bool = False) -> set[str]:
    """The ddpkit modules ``path`` imports (see :func:`_imports`)."""
    found: set[str] = set()
    for node in _imports(path, type_checking=type_checking):
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


def _named_modules(path: Path) -> set[str]:
    """ddpkit modules ``path`` imports by name at run time: ``importlib.import_module("...")``
    and tables of module names (``lazy_exports(globals(), {"name": "ddpkit.x"})``, a backend
    registry), every value of which names a ddpkit module."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module"):
            found.update(
                arg.value
                for arg in node.args[:1]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
            )
        elif isinstance(node, ast.Dict) and node.values:
            values = [v.value if isinstance(v, ast.Constant) else None for v in node.values]
            if all(isinstance(v, str) and v.startswith("ddpkit.") for v in values):
                found.update(str(v) for v in values)
    return found


def import_graph(*, type_checking: bool = False) -> dict[str, set[str]]:
    """module -> the ddpkit modules it imports; with ``type_checking``, also the imports under
    ``if TYPE_CHECKING:`` and the modules imported by name (see :func:`_named_modules`)."""
    files = {_module_name(p): p for p in SRC.joinpath("ddpkit").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        # a module's own parent packages are being imported already: no edge to them
        parents = {name.rsplit(".", k)[0] for k in range(1, name.count(".") + 1)}
        found = _runtime_imports(path, package, type_checking=type_checking)
        if type_checking:
            found |= _named_modules(path)
        graph[name] = {m for m in found if m in files and m != name} - parents
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
        needs.module(via)  # optional extras; the dev extra installs both
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


# --- the layers: an allowed-imports table, checked against every import ----------------------

# The modules at the bottom (stdlib, torch-free except compat's guarded reaches).
BOTTOM = {"contract", "errors", "hints", "compat", "_lazy", "masking"}
# layer -> the layers its modules may import (its own always). The README's house:
# bottom <- cluster <- {worker, jobs (siblings: neither imports the other)} <- launch <- tools
# <- cli; components (torchx's) beside launch, on jobs; ddpkit/__init__ and __main__ on top.
ALLOWED: dict[str, set[str]] = {
    "bottom": set(),
    "cluster": {"bottom"},
    "worker": {"bottom", "cluster"},
    "jobs": {"bottom", "cluster"},
    "components": {"bottom", "cluster", "jobs"},
    "launch": {"bottom", "cluster", "worker", "jobs"},
    "tools": {"bottom", "cluster", "worker", "jobs", "launch"},
    "cli": {"bottom", "cluster", "worker", "jobs", "launch", "tools"},
    "top": {"bottom", "cluster", "worker", "jobs", "components", "launch", "tools", "cli"},
}


def layer_of(module: str) -> str | None:
    """The layer of a ddpkit module (None: a module the table does not place)."""
    if module in ("ddpkit", "ddpkit.__main__"):
        return "top"
    first = module.split(".")[1]
    if first in BOTTOM:
        return "bottom"
    return first if first in ALLOWED else None


def layer_violations(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """Every (importer, imported) pair of ``graph`` the table does not allow."""
    found = set()
    for importer, imported in ((a, b) for a in graph for b in graph[a]):
        low, high = layer_of(importer), layer_of(imported)
        if low is None or high is None or (high != low and high not in ALLOWED[low]):
            found.add((importer, imported))
    return found


def test_every_module_has_a_layer() -> None:
    assert sorted(m for m in import_graph() if layer_of(m) is None) == []


def test_every_import_goes_down_the_layers() -> None:
    """Every import counts: lazy ones inside functions, the ones under ``if TYPE_CHECKING:`` (a
    type from a higher layer ties the lower one to it all the same) and modules imported by
    name (``lazy_exports`` tables, ``import_module``)."""
    found = layer_violations(import_graph(type_checking=True))
    assert sorted(found) == [], "upward imports"


def test_type_checking_and_named_imports_are_in_the_graph() -> None:
    graph = import_graph(type_checking=True)
    assert "ddpkit.worker.context" in graph["ddpkit"]  # lazy_exports table
    assert graph["ddpkit"] - import_graph()["ddpkit"]  # more than the import statements


@pytest.mark.parametrize("layer", sorted(set(ALLOWED) - {"top"}))
def test_an_injected_upward_import_is_reported(layer: str) -> None:
    """For each layer, an import of every layer it may not import is caught, so the table
    cannot pass by catching nothing."""
    graph = import_graph(type_checking=True)
    modules = {name: sorted(m for m in graph if layer_of(m) == name) for name in ALLOWED}
    importer = modules[layer][0]
    forbidden = sorted(set(ALLOWED) - ALLOWED[layer] - {layer})
    assert forbidden  # every layer below the top has one above it
    for above in forbidden:
        imported = modules[above][0]
        injected = {**graph, importer: graph[importer] | {imported}}
        assert (importer, imported) in layer_violations(injected) - layer_violations(graph)


# --- the tests' own layout -------------------------------------------------------------------

TESTS = Path(__file__).resolve().parent
_CLUSTER_FIXTURES = {"slurm", "slurm_cluster"}


def _uses_real_cluster(tree: ast.Module) -> bool:
    """Whether a test file asks for the real SLURM test cluster (its fixtures, by parameter or
    ``usefixtures``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names = {a.arg for a in node.args.args}
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("usefixtures"):
            names = {getattr(a, "value", None) for a in node.args}
        else:
            continue
        if names & _CLUSTER_FIXTURES:
            return True
    return False


def _slurm_marks(tree: ast.Module) -> tuple[bool, int]:
    """(a module-level ``pytestmark`` with ``pytest.mark.slurm``, how many other slurm marks)."""
    module_mark = any(
        isinstance(node, ast.Assign)
        and any(ast.unparse(t) == "pytestmark" for t in node.targets)
        and "pytest.mark.slurm" in ast.unparse(node.value)
        for node in tree.body
    )
    total = sum(
        1
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and ast.unparse(node) == "pytest.mark.slurm"
    )
    return module_mark, total - module_mark


@pytest.mark.parametrize(
    "path", sorted(TESTS.rglob("test_*.py")), ids=lambda p: str(p.relative_to(TESTS))
)
def test_real_cluster_tests_are_named_for_it(path: Path) -> None:
    """A file that uses the real SLURM cluster ends in ``_cluster.py`` and is marked ``slurm``
    as a whole; no other file uses the cluster or carries the mark."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    named = path.name.endswith("_cluster.py")
    assert _uses_real_cluster(tree) == named, "real-cluster tests live in *_cluster.py files"
    assert _slurm_marks(tree) == (named, 0), "*_cluster.py files: `pytestmark = pytest.mark.slurm`"
