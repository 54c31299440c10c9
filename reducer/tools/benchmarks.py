"""``python -m reducer benchmark``: the repository's benchmark scripts, listed and run.

    python -m reducer benchmark                          # what there is, one line each
    python -m reducer benchmark published_figures --quick
    python -m reducer benchmark gpu_check                # bash benchmarks/gpu_check.sh

The scripts live in ``benchmarks/`` of a clone (they are not installed with the package): the
one beside the ``reducer`` package being run, else one in the working directory. Each runs
in a process of its own, with that clone first on PYTHONPATH (so it measures the code beside
it), and its exit code is the command's. Results are recorded in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
from pathlib import Path

from . import catalog

__all__ = ["add_arguments", "find_benchmarks", "run", "scripts"]


def find_benchmarks() -> Path | None:
    """The ``benchmarks/`` directory of this clone (beside the ``reducer`` package), else of
    the working directory; None where neither is one of this project's."""
    here = Path(__file__).resolve().parents[2] / "benchmarks"
    for candidate in (here, Path.cwd() / "benchmarks"):
        if (candidate / "_common.py").is_file():
            return candidate
    return None


def scripts(directory: Path) -> dict[str, tuple[Path, str]]:
    """name -> (path, the first sentence of its docstring): every script of ``directory``
    (a ``*.py`` with a ``__main__`` block, not starting with ``_``; a ``*.sh``; of a script
    and a shell script of one name, the shell one, which runs the other)."""
    found: dict[str, tuple[Path, str]] = {}
    for path in sorted(directory.glob("*.py")):
        if not path.name.startswith("_") and _is_script(path):
            found[path.stem] = (path, _summary(path))
    for path in sorted(directory.glob("*.sh")):
        found[path.stem] = (path, _shell_summary(path))
    return found


def _is_script(path: Path) -> bool:
    try:
        return '__name__ == "__main__"' in path.read_text(encoding="utf-8")
    except OSError:
        return False


def _summary(path: Path) -> str:
    try:
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    except (OSError, SyntaxError):
        return ""
    return _first_sentence(doc.split("\n\n")[0])


def _shell_summary(path: Path) -> str:
    """The first sentence of the comment after the shebang."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return ""
    comment = []
    for line in lines[1:]:
        if not line.startswith("#"):
            break
        comment.append(line.lstrip("#").strip())
    return _first_sentence(" ".join(comment))


def _first_sentence(text: str) -> str:
    words = " ".join(text.split())
    end = words.find(". ")
    return words if end < 0 else words[: end + 1]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "name", nargs="?", default=None, help="the benchmark to run (none: list them)"
    )
    rest = parser.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's arguments")
    rest.required = False


def run(args: argparse.Namespace) -> int:
    """List the benchmarks, or run one; its exit code (2 where there is none)."""
    directory = find_benchmarks()
    if directory is None:
        print(
            "benchmark: no benchmarks/ directory here: the benchmark scripts come with a "
            "clone of the repository, not with the installed package; run this from the clone",
            file=sys.stderr,
        )
        return 2
    found = scripts(directory)
    if args.name is None:
        entries = [(name, summary) for name, (_, summary) in found.items()]
        print(catalog.listing(f"benchmarks in {directory} (run one: NAME [ARGS...])", entries))
        return 0
    name = args.name.removesuffix(".py").removesuffix(".sh")
    if name not in found:
        print(
            f"benchmark: no benchmark {args.name!r} in {directory}; there are {', '.join(found)}",
            file=sys.stderr,
        )
        return 2
    path = found[name][0]
    command = ["bash", str(path)] if path.suffix == ".sh" else [sys.executable, str(path)]
    env = dict(os.environ)
    root = str(directory.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return subprocess.call([*command, *args.args], cwd=root, env=env)
