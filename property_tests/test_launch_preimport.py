"""Property 9: ``launch`` pre-imports exactly a script's leading imports.

Before the rank threads start, ``python -m reducer launch`` runs the script's leading import
statements once (``reducer.tools.launch.imports.preimport``): the imports at its top, up to
the first other statement. An import after any other statement (``os.environ[...] = ...``,
``sys.path.insert``) may depend on it and must be left to the ranks. Hypothesis draws
scripts: an optional docstring and ``from __future__`` line, then imports and other
statements in any order; each import names a probe module that records being imported. After
the pre-import exactly the leading block's probes are imported, in the script's order.
"""

from __future__ import annotations

import ast
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import ModuleType

from hypothesis import event, given
from hypothesis import strategies as st

from reducer.tools.launch import imports

_PREFIX = "_launch_probe_"
_OTHERS = (
    "import os as _os_probe_alias_unused",  # an import of an existing module: still an import
    "X = 1",
    "os_environ_probe = {'MASTER_PORT': '29500'}",
    "print('setting up')",
    "def f():\n    import json\n    return json",
)


class _Probes(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Empty modules ``_launch_probe_<n>``, each recording its import in ``imported``."""

    def __init__(self) -> None:
        self.imported: list[str] = []

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(_PREFIX):
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        self.imported.append(module.__name__)


@contextmanager
def _probes() -> Iterator[_Probes]:
    probes = _Probes()
    sys.meta_path.insert(0, probes)
    try:
        yield probes
    finally:
        sys.meta_path.remove(probes)
        for name in [n for n in sys.modules if n.startswith(_PREFIX)]:
            del sys.modules[name]


@st.composite
def scripts(draw: st.DrawFn) -> tuple[str, list[str]]:
    """A script's source and the probe modules of its leading import block, in order."""
    lines: list[str] = []
    if draw(st.booleans()):
        lines.append('"""A training script."""')
    if draw(st.booleans()):
        lines.append("from __future__ import annotations")
    leading: list[str] = []
    still_leading = True
    for n in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["import", "from", "other", "environ"]))
        if kind == "import":
            lines.append(f"import {_PREFIX}{n}")
        elif kind == "from":
            lines.append(f"from {_PREFIX}{n} import *")
        elif kind == "environ":
            lines.append("import os")  # an import itself: the block goes on
            lines.append("os.environ['MASTER_ADDR'] = 'localhost'")
            still_leading = False
            continue
        else:
            lines.append(draw(st.sampled_from(_OTHERS)))
            if not lines[-1].startswith("import"):
                still_leading = False
            continue
        if still_leading:
            leading.append(f"{_PREFIX}{n}")
    return "\n".join(lines) + "\n", leading


def check_preimport(script: tuple[str, list[str]]) -> None:
    """The property: exactly the leading block's probes are imported, in order."""
    source, leading = script
    with _probes() as probes:
        imports.preimport(ast.parse(source), "<script>", None)
    assert probes.imported == leading, (
        f"pre-imported {probes.imported}, expected the leading block's {leading}:\n{source}"
    )


@given(scripts())
def test_launch_preimports_exactly_the_leading_imports(script: tuple[str, list[str]]) -> None:
    source, leading = script
    event(f"an import after another statement: {source.count(_PREFIX) > len(leading)}")
    check_preimport(script)
