"""The supported torch range: older torch is refused at import with the versions named, and
the range, the tox environments and the docs agree."""

from __future__ import annotations

import configparser
import itertools
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reducer._torch_version import MINIMUM, TESTED, require_supported_torch, torch_minor

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("version", "minor"),
    [
        ("2.11.0", (2, 11)),
        ("2.11.0+cu130", (2, 11)),
        ("2.13.0+cpu", (2, 13)),
        ("2.12.0a0+git1234abc", (2, 12)),
        ("10.1", (10, 1)),
        ("2.1", (2, 1)),
        ("", None),
        ("2", None),
        ("unknown", None),
        ("2.x.0", None),
    ],
)
def test_torch_minor(version: str, minor: tuple[int, int] | None) -> None:
    assert torch_minor(version) == minor


@pytest.mark.parametrize("version", ["2.11.0", "2.11.0+cu130", "2.12.1", "2.14.1", "2.15.0"])
def test_supported_and_newer_torch_is_accepted(
    monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    monkeypatch.setattr(torch, "__version__", version)
    require_supported_torch()  # raises if refused


@pytest.mark.parametrize("version", ["2.10.0", "2.8.0", "2.4.1", "1.13.1", "2.1.0+cu118"])
def test_older_torch_is_refused_naming_both_versions(
    monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    monkeypatch.setattr(torch, "__version__", version)
    with pytest.raises(RuntimeError) as info:
        require_supported_torch()
    message = str(info.value)
    assert f"torch {version} (at " in message
    assert "needs torch >= 2.11," in message
    assert "pip install 'torch>=2.11'" in message
    assert "tested: 2.11, 2.12, 2.13, 2.14" in message


def test_an_unreadable_version_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "__version__", "unknown")
    with pytest.raises(RuntimeError, match=r"version 'unknown' cannot be read as major\.minor"):
        require_supported_torch()


@pytest.mark.parametrize("package", ["reducer", "fakepg", "reducer.tools.launch"])
def test_importing_the_package_on_older_torch_fails_with_the_message(package: str) -> None:
    """The refusal comes first: before any module could fail on an API old torch lacks."""
    code = f"import torch\ntorch.__version__ = '2.8.0'\nimport {package}\n"
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: ddp-reducer needs torch >= 2.11, but this is torch 2.8.0")


def test_tested_minors_are_consecutive_from_the_floor() -> None:
    assert MINIMUM == TESTED[0] == (2, 11)
    assert list(TESTED) == sorted(set(TESTED))
    assert all(b == (a[0], a[1] + 1) for a, b in itertools.pairwise(TESTED))


def _tox() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(ROOT / "tox.ini")
    return parser


def test_tox_has_one_environment_per_tested_minor() -> None:
    tox = _tox()
    section = "testenv:torch{" + ",".join(f"{a}{b}" for a, b in TESTED) + "}"
    assert section in tox, f"tox.ini needs [{section}]"
    deps = tox[section]["deps"].split()
    for a, b in TESTED:
        assert f"torch{a}{b}:" in deps
        assert f"torch=={a}.{b}.*" in deps
    labels = tox["tox"]["labels"]
    assert re.search(r"torch\s*=\s*" + r",\s*".join(f"torch{a}{b}" for a, b in TESTED), labels)


def test_the_docs_and_pyproject_state_the_range() -> None:
    page = (ROOT / "docs" / "howto" / "torch-versions.md").read_text()
    rows = re.findall(r"^\| (\d+\.\d+)\.\d+ ", page, flags=re.MULTILINE)
    assert rows == [f"{a}.{b}" for a, b in TESTED]
    readme = (ROOT / "README.md").read_text()
    assert "torch >= 2.3" not in readme and "torch >= 2.3" not in page
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"torch>=2.11",' in pyproject
