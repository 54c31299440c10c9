"""Every code block of README.md and docs/**/*.md runs, and shows what it prints.

The convention every page follows (Sybil parses the pages; the evaluators are here):

- a ```python block runs; the blocks of one page run in order in one namespace, from the
  repository root;
- a ```bash block runs in ``bash`` from the repository root and must exit 0 (a block that
  shows a failure ends with ``echo "exit code $?"`` or the like);
- ``<!-- no-run: <reason> -->`` on the line before a block keeps it from running (the reason
  is required: a GPU, a second machine, minutes of work);
- a ```text block after the line ``<!-- output -->`` is the standard output of the block
  just before it, compared as doctest does with ELLIPSIS: ``...`` matches anything, on a line
  or across lines; trailing spaces and blank lines at the end are ignored;
- any other block (```text, ```toml, ```json without the marker) is shown, never run.

Pages whose blocks take more than a few seconds run in the full run only (``slow``); a page
is slow unless it is listed in ``QUICK_PAGES`` or has nothing to run.
"""

from __future__ import annotations

import contextlib
import doctest
import io
import os
import re
import subprocess
import sys
import traceback
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from sybil import Document, Example, Region, Sybil
from sybil.evaluators.python import pad
from sybil.example import SybilFailure
from sybil.parsers.markdown.lexers import RawFencedCodeBlockLexer

ROOT = Path(__file__).resolve().parent.parent

# Pages whose examples run in a few seconds: the quick run (-m "not slow") runs them too, and
# every page with nothing to run.
QUICK_PAGES = frozenset(
    {
        "docs/design/fake-world.md",
        "docs/howto/reducer-in-your-code.md",
        "docs/howto/torch-versions.md",
        "docs/tutorials/races.md",
    }
)

# The stdout of the last block run on a page, for the ```text block that shows it.
_LAST_OUTPUT = "__docs_last_output__"
_LAST_BLOCK = "__docs_last_block__"
_BASH_TIMEOUT_S = 600.0
_RUN_LANGUAGES = ("python", "bash")
_NO_RUN = re.compile(r"<!--\s*no-run:\s*(?P<reason>\S.*?)\s*-->\s*$")
_NO_RUN_WITHOUT_REASON = re.compile(r"<!--\s*no-run:?\s*-->\s*$")
_OUTPUT = re.compile(r"<!--\s*output\s*-->\s*$")
_INFO = re.compile(r"(?P<language>[^\n]*)$\n", re.MULTILINE)


def _marker_before(document: Document, start: int) -> str:
    """The last non-blank line before a block's opening fence (a marker comment, or text)."""
    lines = document.text[:start].rstrip().rsplit("\n", 1)
    return lines[-1].strip()


def _fail_at(region: Region, document: Document, message: str) -> Region:
    """A region that fails when run: a convention broken is a failure, not a silent skip."""

    def evaluate(example: Example) -> str:
        return message

    region.parsed = message
    region.evaluator = evaluate
    return region


@contextlib.contextmanager
def _cwd(path: Path) -> Iterator[None]:
    """The working directory set for a block (contextlib.chdir is Python 3.11's)."""
    before = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def _run_python(example: Example) -> None:
    """Runs a ```python block in the page's namespace from the repository root."""
    __tracebackhide__ = True
    source = pad(example.parsed, example.line + example.parsed.line_offset)
    code = compile(source, example.path, "exec", dont_inherit=True)
    out = io.StringIO()
    with _cwd(ROOT), contextlib.redirect_stdout(out):
        exec(code, example.namespace)
    example.namespace.pop("__builtins__", None)
    example.namespace[_LAST_OUTPUT] = out.getvalue()
    example.namespace[_LAST_BLOCK] = example.line


def _bash_environment() -> dict[str, str]:
    """The environment of a ```bash block: this checkout first on the path, a fixed width."""
    env = dict(os.environ)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(ROOT) if not path else f"{ROOT}{os.pathsep}{path}"
    # rich lays its tables out to the terminal's width: the same width the pages show.
    env["COLUMNS"] = "100"
    env.setdefault("HYPOTHESIS_PROFILE", "ci")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _run_bash(example: Example) -> str | None:
    """Runs a ```bash block from the repository root; it fails unless it exits 0."""
    result = subprocess.run(
        ["bash", "-c", str(example.parsed)],
        cwd=ROOT,
        env=_bash_environment(),
        capture_output=True,
        text=True,
        timeout=_BASH_TIMEOUT_S,
        check=False,
    )
    example.namespace[_LAST_OUTPUT] = result.stdout
    example.namespace[_LAST_BLOCK] = example.line
    if result.returncode != 0:
        return (
            f"the bash block exited {result.returncode}\n--- stdout ---\n{result.stdout[-4000:]}"
            f"\n--- stderr ---\n{result.stderr[-4000:]}"
        )
    return None


def _normalized(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines()) + "\n"


def output_matches(want: str, got: str) -> bool:
    """Whether ``got`` is ``want`` with each ``...`` standing for anything (doctest ELLIPSIS)."""
    checker = doctest.OutputChecker()
    return checker.check_output(_normalized(want), _normalized(got), doctest.ELLIPSIS)


def _check_output(example: Example) -> str | None:
    """Compares a ```text block after ``<!-- output -->`` with the last block's stdout."""
    if _LAST_OUTPUT not in example.namespace:
        return "<!-- output --> follows no block that ran"
    got = example.namespace.pop(_LAST_OUTPUT)
    want = str(example.parsed)
    if output_matches(want, got):
        return None
    block = example.namespace[_LAST_BLOCK]
    return (
        f"the output of the block at line {block} differs from the page.\n"
        f"--- the page shows ---\n{_normalized(want)}"
        f"--- it printed ---\n{_normalized(got)}"
    )


def parse_blocks(document: Document) -> Iterator[Region]:
    """The runnable regions of a page, by the convention in this module's docstring."""
    lexer = RawFencedCodeBlockLexer(info_pattern=_INFO)
    for region in lexer(document):
        language = str(region.lexemes["language"]).strip()
        marker = _marker_before(document, region.start)
        if _NO_RUN.match(marker):
            continue
        if _NO_RUN_WITHOUT_REASON.match(marker):
            yield _fail_at(region, document, "<!-- no-run: ... --> needs a reason")
            continue
        region.parsed = region.lexemes["source"]
        if _OUTPUT.match(marker):
            if language != "text":
                yield _fail_at(
                    region, document, f"<!-- output --> precedes a ```{language} block, not text"
                )
                continue
            region.evaluator = _check_output
        elif language == "python":
            region.evaluator = _run_python
        elif language == "bash":
            region.evaluator = _run_bash
        else:
            continue
        yield region


def _sybil() -> Sybil:
    return Sybil(parsers=[parse_blocks], path=str(ROOT))


def pages() -> list[str]:
    """README.md and every page under docs/, as paths from the repository root."""
    found = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [path.relative_to(ROOT).as_posix() for path in found]


def run_page(path: Path) -> list[str]:
    """Runs a page's blocks in order; returns what failed (stops at a failing run block)."""
    document = _sybil().parse(path)
    failures: list[str] = []
    for example in document:
        try:
            example.evaluate()
        except SybilFailure as failure:
            failures.append(f"{path}, line {example.line}: {failure.result}")
            if example.region.evaluator is not _check_output:
                break  # the blocks after a failed one depend on it
        except Exception as error:  # the block's own exception, with its traceback
            trace = traceback.format_exc(limit=-8)
            failures.append(
                f"{path}, line {example.line}: {type(error).__name__}: {error}\n{trace}"
            )
            break
    return failures


def _runs_anything(page: str) -> bool:
    return any(True for _ in _sybil().parse(ROOT / page))


def _page_params() -> Iterable[object]:
    for page in pages():
        quick = page in QUICK_PAGES or not _runs_anything(page)
        marks = () if quick else (pytest.mark.slow,)
        yield pytest.param(page, id=page, marks=marks)


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("page", _page_params())
def test_every_block_of_the_page_runs(page: str) -> None:
    failures = run_page(ROOT / page)
    assert not failures, "\n\n".join(failures)


# The convention itself, on small pages written here.


def _write(tmp_path: Path, text: str) -> Path:
    page = tmp_path / "page.md"
    page.write_text(text)
    return page


def test_python_blocks_share_a_namespace_and_their_output_is_checked(tmp_path: Path) -> None:
    page = _write(
        tmp_path,
        "```python\nx = 2\n```\n\n```python\nprint(x * 21)\n```\n\n"
        "<!-- output -->\n```text\n42\n```\n",
    )
    assert run_page(page) == []


def test_a_wrong_output_fails_naming_both(tmp_path: Path) -> None:
    page = _write(tmp_path, "```python\nprint(41)\n```\n<!-- output -->\n```text\n42\n```\n")
    (failure,) = run_page(page)
    assert "differs from the page" in failure and "41" in failure and "42" in failure


def test_ellipsis_matches_within_a_line_and_across_lines() -> None:
    assert output_matches("step ... ms\n...\nend", "step 3.14 ms\na\nb\nend")
    assert not output_matches("step ... ms", "stop 3.14 ms")


def test_no_run_skips_the_next_block_only(tmp_path: Path) -> None:
    page = _write(
        tmp_path,
        "<!-- no-run: needs a GPU -->\n```python\nraise SystemError\n```\n\n"
        "```bash\necho ran\n```\n<!-- output -->\n```text\nran\n```\n",
    )
    assert run_page(page) == []


def test_no_run_without_a_reason_fails(tmp_path: Path) -> None:
    page = _write(tmp_path, "<!-- no-run: -->\n```python\nprint(1)\n```\n")
    (failure,) = run_page(page)
    assert "needs a reason" in failure


def test_a_bash_block_that_exits_non_zero_fails(tmp_path: Path) -> None:
    page = _write(tmp_path, "```bash\necho out; echo err >&2; exit 3\n```\n")
    (failure,) = run_page(page)
    assert "exited 3" in failure and "err" in failure


def test_a_python_block_that_raises_fails_naming_the_page(tmp_path: Path) -> None:
    page = _write(tmp_path, "text\n\n```python\nraise ValueError('boom')\n```\n")
    (failure,) = run_page(page)
    assert "page.md" in failure and "ValueError: boom" in failure


def test_other_blocks_are_shown_not_run(tmp_path: Path) -> None:
    page = _write(tmp_path, "```text\nnot code\n```\n\n```toml\n[a]\n```\n\n```\nplain\n```\n")
    assert run_page(page) == []


def test_output_without_a_block_before_it_fails(tmp_path: Path) -> None:
    page = _write(tmp_path, "<!-- output -->\n```text\n42\n```\n")
    (failure,) = run_page(page)
    assert "follows no block that ran" in failure


def test_every_page_is_collected() -> None:
    collected = set(pages())
    assert "README.md" in collected and "docs/howto/cli.md" in collected


def _readme_commands() -> list[str]:
    """The README's ```bash blocks' lines that run pytest."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.DOTALL)
    return [line.strip() for block in blocks for line in block.splitlines() if "pytest" in line]


def test_the_readme_gives_a_quick_and_a_full_test_command_and_ci_runs_the_full_one() -> None:
    quick, full = _readme_commands()
    assert quick == 'HYPOTHESIS_PROFILE=ci pytest -m "not slow"'
    assert full == "HYPOTHESIS_PROFILE=ci pytest"
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert full in ci_lines, "the README's full test command must be what .ci/run runs"


def test_the_readme_is_a_front_page() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move the rest to docs/"


@pytest.mark.slow
def test_the_site_builds_with_warnings_as_errors(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="the docs extra: pip install -e '.[docs]'")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]


def test_the_readmes_links_name_files_that_exist() -> None:
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    local = [target for target in targets if "://" not in target]
    assert local, "the README links to the docs"
    missing = [target for target in local if not (ROOT / target).exists()]
    assert not missing, missing
