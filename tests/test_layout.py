"""The package layout: the import graph of ``reducer`` and ``fakepg`` has no circles, and its
edges point one way: tools (``reducer.tools``, and the testing library ``reducer.testing``) ->
torch's wrapper (``reducer.ddp``) and the comm hooks (``reducer.hooks``) -> core (the rest of
``reducer``: the seed's reducer) -> protocol (``reducer.process_group``,
``reducer.collectives``); ``fakepg`` -> protocol. The testing library sits beside the tools:
it imports the core and ``fakepg``, never the tools. The package's ``__init__`` (``reducer``)
is its public face: it re-exports from every layer below the tools, and nothing inside imports
it back.

The graph is read from the source with ``ast``, so it sees every import: those at the top of a
module, those under ``if TYPE_CHECKING:`` (a circle there is still a circle for a reader and for
the type checker) and those inside functions (a circle deferred to call time is still a circle).
An edge goes from a module to the module it names; a package's ``__init__`` is the package's
module. The parent packages Python imports on the way are not edges: every submodule would
otherwise be in a circle with its package's ``__init__``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("reducer", "fakepg")

# The protocol: what every process group implements and the argument rules they share. It
# imports nothing else of the project.
PROTOCOL = frozenset({"reducer.process_group", "reducer.collectives"})
# What fakepg may import from reducer: the protocol, nothing else. fakepg is a backend, not a
# user of the reducer (its errors are its own: fakepg.FakePGError and subclasses).
FAKEPG_MAY_IMPORT = PROTOCOL
TOOLS = "reducer.tools"
# The testing library (strategies, the exact reference, checks, the pytest plugin): a tool
# layer for users' own tests, built on the core and the fake world.
TESTING = "reducer.testing"
# torch's DistributedDataParallel around the core, and the built-in comm hooks: the layer that
# torch keeps in torch/nn/parallel/distributed.py and algorithms/ddp_comm_hooks/.
DDP = "reducer.ddp"
HOOKS = "reducer.hooks"
# The package's __init__: the public names, re-exported.
PUBLIC_FACE = "reducer"
# ``python -m reducer`` runs this module as a script: it hands the command line to the tools,
# and nothing imports it, so it sits above the tools, not in the core.
ENTRY_POINT = "reducer.__main__"


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imported(module: str, path: Path, known: set[str]) -> Iterator[str]:
    """The dotted names that ``module`` imports anywhere in its source (top level,
    ``TYPE_CHECKING`` blocks, function bodies), relative imports resolved; ``from X import y``
    is an import of ``X.y`` when that is a module, else of ``X``."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                base = module.split(".")
                if not is_package:
                    base.pop()  # a module's relative imports start from its package
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                yield submodule if submodule in known else target


def import_graph(root: Path, packages: Sequence[str]) -> dict[str, set[str]]:
    """module -> the modules of ``packages`` it imports (imports of anything else dropped)."""
    modules = {
        _module_name(root, path): path
        for package in packages
        for path in sorted((root / package).rglob("*.py"))
    }
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        edges = set()
        for name in _imported(module, path, known):
            # ``import a.b.c`` where c is a name, not a module: the longest known prefix.
            parts = name.split(".")
            while parts and ".".join(parts) not in known:
                parts.pop()
            if parts and ".".join(parts) != module:
                edges.add(".".join(parts))
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path ``[a, b, ..., a]``, or None. Depth-first, in name order,
    so the report is the same on every run."""
    state: dict[str, int] = {}  # 1: on the current path; 2: finished, no circle through it
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for succ in sorted(graph.get(node, ())):
            if state.get(succ) == 1:
                return [*path[path.index(succ) :], succ]
            if succ not in state and (found := visit(succ)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


GRAPH = import_graph(ROOT, PACKAGES)


def _edges(source: str, target: str, *, except_to: frozenset[str] = frozenset()) -> list[str]:
    """Every ``a imports b`` with a in ``source`` and b in ``target``, except b in
    ``except_to``."""
    return sorted(
        f"{module} imports {imported}"
        for module, targets in GRAPH.items()
        if _in(module, source)
        for imported in targets
        if _in(imported, target) and imported not in except_to
    )


def test_the_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    # The reader itself, on a package made for it: relative imports from a module and from a
    # package's __init__ (one and two levels), an import under TYPE_CHECKING, one inside a
    # function, ``import a.b.c`` and ``from a import module``. Without this, the checks below
    # could pass by seeing nothing.
    files = {
        "pkg/__init__.py": "from .a import x\n",
        "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import Y\n",
        "pkg/b.py": "def f():\n    from . import c\n",
        "pkg/c.py": "import os\nimport pkg.sub.d\n",
        "pkg/sub/__init__.py": "from ..a import x\n",
        "pkg/sub/d.py": "from pkg import b\nfrom . import e\n",
        "pkg/sub/e.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path, ["pkg"])
    assert graph == {
        "pkg": {"pkg.a"},
        "pkg.a": {"pkg.b"},
        "pkg.b": {"pkg.c"},
        "pkg.c": {"pkg.sub.d"},
        "pkg.sub": {"pkg.a"},
        "pkg.sub.d": {"pkg.b", "pkg.sub.e"},
        "pkg.sub.e": set(),
    }
    assert find_cycle(graph) == ["pkg.b", "pkg.c", "pkg.sub.d", "pkg.b"]
    # And on the project: a function-local import (the tools import fakepg only when run).
    assert "fakepg" in GRAPH["reducer.tools.launch"]


def test_find_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"a"}}) == ["a", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set(), "d": {"a", "b"}}) is None


def test_no_import_circles() -> None:
    cycle = find_cycle(GRAPH)
    assert cycle is None, (
        "import circle: " + " -> ".join(cycle or []) + ". Break it: move what both sides "
        "need into a module below both, or name it with a typing.Protocol"
    )


def test_the_protocol_imports_nothing_else_of_the_project() -> None:
    bad = sorted(
        f"{module} imports {imported}"
        for module in PROTOCOL
        for imported in GRAPH[module]
        if imported not in PROTOCOL
    )
    assert not bad, f"the protocol ({sorted(PROTOCOL)}) must stand alone: {bad}"


def test_fakepg_imports_only_the_protocol_from_reducer() -> None:
    bad = _edges("fakepg", "reducer", except_to=FAKEPG_MAY_IMPORT)
    assert not bad, f"fakepg may import from reducer only {sorted(FAKEPG_MAY_IMPORT)}: {bad}"
    assert _edges("fakepg", "reducer"), "fakepg implements the protocol; it should import it"


def _in_core(module: str) -> bool:
    return (
        _in(module, "reducer")
        and module not in (PUBLIC_FACE, ENTRY_POINT)
        and not any(_in(module, layer) for layer in (TOOLS, TESTING, DDP, HOOKS))
    )


def test_the_core_never_imports_the_wrapper_nor_the_hooks() -> None:
    bad = sorted(
        f"{module} imports {imported}"
        for module, targets in GRAPH.items()
        if _in_core(module)
        for imported in targets
        if _in(imported, DDP) or _in(imported, HOOKS) or imported == PUBLIC_FACE
    )
    assert not bad, (
        f"the core (the seed's reducer) must not import torch's wrapper ({DDP}), the comm "
        f"hooks ({HOOKS}) or the package's public face: {bad}. Move what the core needs "
        "into the core (as the hook protocol lives in reducer.comm_hook)"
    )
    # The layers exist and sit on the core: the wrapper on the core and the hooks, the hooks
    # on the core alone.
    assert [e for e in _edges(DDP, "reducer") if _in_core(e.split()[-1])]
    assert _edges(DDP, HOOKS)
    assert [e for e in _edges(HOOKS, "reducer") if _in_core(e.split()[-1])]
    assert not _edges(HOOKS, DDP), f"the comm hooks must not import the wrapper ({DDP})"
    for layer in (DDP, HOOKS):
        assert not _edges(layer, TOOLS) and not _edges(layer, TESTING), (
            f"{layer} must not import the tools or the testing library"
        )
        assert not _edges(layer, "fakepg"), f"{layer} must not import fakepg"


def test_the_ground_floor_holds_the_core_only() -> None:
    # What the seed's reducer is made of lies on reducer/'s ground floor; torch's wrapper and
    # the hooks live in their packages, so no private DDP helper or hook sits beside the core.
    ground = sorted(p.stem for p in (ROOT / "reducer").glob("*.py"))
    strays = [
        name
        for name in ground
        if name.startswith("_ddp")
        or name in ("ddp", "comm_hooks", "_join", "_powersgd")
        or name == "_post_local_sgd"
    ]
    assert not strays, f"reducer/ holds wrapper or hook modules: {strays}"
    assert (ROOT / "reducer" / "ddp" / "__init__.py").is_file()
    assert (ROOT / "reducer" / "hooks" / "__init__.py").is_file()


def test_the_core_never_imports_the_tools_nor_the_fake_world() -> None:
    bad = sorted(
        f"{module} imports {imported}"
        for module, targets in GRAPH.items()
        if _in_core(module)
        for imported in targets
        if _in(imported, TOOLS) or _in(imported, TESTING) or _in(imported, "fakepg")
    )
    assert not bad, (
        f"the core (reducer outside {TOOLS} and {TESTING}) must not import tools, the testing "
        f"library or fakepg: {bad}"
    )


def test_the_testing_library_sits_on_the_core_and_the_fake_world() -> None:
    assert not _edges(TESTING, TOOLS), f"{TESTING} must not import the tools"
    # The allowed direction is the one in use: it imports both the core and fakepg.
    assert _edges(TESTING, "fakepg")
    # (through the public face, ``import reducer``, as users' tests do)
    assert [
        e
        for e in _edges(TESTING, "reducer")
        if not _in(e.split()[-1], TESTING) and not _in(e.split()[-1], TOOLS)
    ]


def test_only_python_m_reducer_reaches_the_tools_from_outside() -> None:
    assert GRAPH[ENTRY_POINT] == {"reducer.tools.cli"}
    assert not [m for m, targets in GRAPH.items() if ENTRY_POINT in targets]


def test_the_tools_sit_on_the_core_and_the_fake_world() -> None:
    # The allowed direction is the one in use: tools import both the core and fakepg.
    assert _edges(TOOLS, "fakepg")
    assert [e for e in _edges(TOOLS, "reducer") if not _in(e.split()[-1], TOOLS)]


@pytest.mark.slow
def test_python_m_reducer_lists_its_subcommands() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "reducer", "--help"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        timeout=120,
    ).stdout
    for command in ("simulate", "validate", "launch"):
        assert f"    {command} " in out, out


def test_the_replica_check_stands_below_launch() -> None:
    # launch uses the check; the check knows nothing of launch or the command line (Python
    # code calls it directly), and the fake world knows nothing of it (it only offers
    # World.observe).
    check = "reducer.tools.check"
    assert any(_in(t, check) for t in GRAPH["reducer.tools.launch"])
    bad = _edges(check, "reducer.tools.launch") + _edges(check, "reducer.tools.cli")
    assert not bad, f"the check must not import launch or the CLI: {bad}"
    assert not _edges("fakepg", check)
