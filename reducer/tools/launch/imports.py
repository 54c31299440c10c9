"""The script's leading imports, run once on the launching thread before the rank threads start.

Rank threads share ``sys.modules``. Python's import of one module is thread-safe, but a
library's lazy attributes often are not: transformers' ``_LazyModule`` imports a submodule the
first time one of its names is read, and when N rank threads run ``from transformers import
GPT2Model`` at once, one of them can find a half-imported module and fail with an ImportError.
Under torchrun each process imports alone. So before the ranks start, the launch runs the
script's leading import statements (the imports at its top, before any other statement: what
every rank runs first anyway) once, on the launching thread, and reads once each attribute
that the script takes from a module bound there (``transformers.AutoModel``), so that the ranks
find everything already imported. See Note [Imports before the ranks start].

# Guarantees: called on the launching thread, before any rank thread exists.
"""

from __future__ import annotations

import ast
import builtins
import warnings
from collections.abc import Iterator
from types import CodeType, ModuleType

__all__: list[str] = []

# Note [Imports before the ranks start]
# Only the leading block is run (after the docstring, up to the first statement that is not an
# import), in the script's order: a later import may depend on what the script did before it
# (sys.path.insert, os.environ), and then it is not the launch's to run early. It runs with
# rank 0's environment and output (a module's globals are shared by every rank anyway: whoever
# imports first sets them, under torchrun each process). An import that fails here stops the
# pre-import and is left to the ranks: each runs it itself, as torchrun's workers would, and
# reports its own error at the script's line. Imports in functions, or after other statements,
# run on the rank threads as written.


def leading_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The import statements at the top of ``tree``, up to its first other statement."""
    found: list[ast.Import | ast.ImportFrom] = []
    for index, node in enumerate(tree.body):
        if isinstance(node, ast.Import | ast.ImportFrom):
            if not (isinstance(node, ast.ImportFrom) and node.module == "__future__"):
                found.append(node)
        elif not (index == 0 and _is_docstring(node)):
            break
    return found


def preimport(tree: ast.Module, filename: str, package: str | None) -> None:
    """Run ``tree``'s leading imports once (see the module's docstring), then read the module
    attributes the script uses. Errors are left to the ranks: see Note [Imports before the
    ranks start]."""
    namespace: dict[str, object] = {
        "__name__": "__reducer_launch_preimport__",
        "__package__": package,
        "__builtins__": builtins,
    }
    for node in leading_imports(tree):
        try:
            exec(_compile_one(node, filename), namespace)
        except Exception:  # the rank threads run it again, and each reports its own error
            break
    modules = {name: value for name, value in namespace.items() if isinstance(value, ModuleType)}
    # A module's __getattr__ may warn (deprecations); the script's own reads warn, not these.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, chain in _attribute_chains(tree, set(modules)):
            _touch(modules[name], chain)


def _compile_one(node: ast.stmt, filename: str) -> CodeType:
    # Line numbers kept: a traceback names the script's own line.
    return compile(ast.Module(body=[node], type_ignores=[]), filename, "exec")


def _is_docstring(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    )


def _attribute_chains(tree: ast.Module, names: set[str]) -> Iterator[tuple[str, list[str]]]:
    """``(name, [attr, ...])`` for each ``name.attr.attr...`` read anywhere in ``tree``."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain: list[str] = []
        value: ast.expr = node
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if isinstance(value, ast.Name) and value.id in names:
            yield value.id, chain[::-1]


def _touch(module: ModuleType, chain: list[str]) -> None:
    """Read ``module.a.b...`` while the values are modules (a lazy module imports the
    submodule behind a name on first read); any error is the script's to meet later."""
    value: object = module
    for attr in chain:
        if not isinstance(value, ModuleType):
            return
        try:
            value = getattr(value, attr)
        except Exception:
            return
