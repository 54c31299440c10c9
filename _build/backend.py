"""The build backend: setuptools, run on a temporary copy of the source tree for wheels and
sdists, so that ``pip install .`` (not editable) from a clone writes nothing into it (no
``build/``, no ``*.egg-info``). Editable installs point at the tree itself and run in place.

Named in pyproject.toml (``build-backend = "backend"``, ``backend-path = ["_build"]``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from setuptools import build_meta as _setuptools

# What a build reads from the tree; nothing else is copied.
_SOURCES = ("pyproject.toml", "README.md", "reducer", "fakepg")


@contextlib.contextmanager
def _in_a_copy() -> Iterator[None]:
    here = Path.cwd()
    with tempfile.TemporaryDirectory(prefix="ddp-reducer-build-") as tmp:
        for name in _SOURCES:
            source = here / name
            if source.is_dir():
                shutil.copytree(
                    source, Path(tmp) / name, ignore=shutil.ignore_patterns("__pycache__")
                )
            elif source.exists():
                shutil.copy2(source, Path(tmp) / name)
        os.chdir(tmp)
        try:
            yield
        finally:
            os.chdir(here)


def _absolute(directory: str) -> str:
    return str(Path(directory).resolve())


def get_requires_for_build_wheel(config_settings: Any = None) -> list[str]:
    with _in_a_copy():
        return _setuptools.get_requires_for_build_wheel(config_settings)


def get_requires_for_build_sdist(config_settings: Any = None) -> list[str]:
    with _in_a_copy():
        return _setuptools.get_requires_for_build_sdist(config_settings)


def prepare_metadata_for_build_wheel(metadata_directory: str, config_settings: Any = None) -> str:
    target = _absolute(metadata_directory)
    with _in_a_copy():
        return _setuptools.prepare_metadata_for_build_wheel(target, config_settings)


def build_wheel(
    wheel_directory: str, config_settings: Any = None, metadata_directory: str | None = None
) -> str:
    target = _absolute(wheel_directory)
    metadata = None if metadata_directory is None else _absolute(metadata_directory)
    with _in_a_copy():
        return _setuptools.build_wheel(target, config_settings, metadata)


def build_sdist(sdist_directory: str, config_settings: Any = None) -> str:
    target = _absolute(sdist_directory)
    with _in_a_copy():
        return _setuptools.build_sdist(target, config_settings)


# Editable installs run in the tree: the installed package must point at it.
get_requires_for_build_editable = _setuptools.get_requires_for_build_editable
prepare_metadata_for_build_editable = _setuptools.prepare_metadata_for_build_editable
build_editable = _setuptools.build_editable
