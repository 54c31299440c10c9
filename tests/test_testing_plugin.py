"""The pytest plugin of ``reducer.testing``: its fixtures and its profile option, run in a
pytest of its own (a subprocess, so that the option and the profile it loads stay there)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

import reducer.testing
import reducer.testing.plugin

ROOT = Path(__file__).resolve().parent.parent

USER_TESTS = """
import pytest
import torch
import torch.distributed as dist
from hypothesis import settings


def test_fake_world_has_two_ranks_by_default(fake_world):
    assert fake_world.world_size == 2


@pytest.mark.parametrize("world_size", [3])
def test_on_every_rank_sums_in_rank_order(on_every_rank, world_size):
    def step(pg):
        t = torch.full((2,), float(pg.rank() + 1))
        pg.allreduce([t]).wait()
        return t

    assert [t.tolist() for t in on_every_rank(step)] == [[6.0, 6.0]] * 3


def test_on_every_rank_with_torch_groups(on_every_rank):
    def step(pg):
        t = torch.ones(1)
        dist.all_reduce(t)
        return (dist.get_rank(), dist.get_world_size(), t.item())

    assert on_every_rank(step, torch=True) == [(0, 2, 2.0), (1, 2, 2.0)]


def test_the_profile_option_loaded_ci():
    assert settings().derandomize and settings().max_examples == 25
"""


# Loaded by name where the package's entry point does not load it already (pytest refuses a
# plugin registered twice).
LOAD = () if reducer.testing.plugin.loaded_by_entry_point() else ("-p", "reducer.testing.plugin")


def _pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_user.py").write_text(textwrap.dedent(USER_TESTS))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("HYPOTHESIS_PROFILE", None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args, str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=240,
        check=False,
    )


@pytest.mark.slow
def test_the_fixtures_and_the_profile_option_in_a_users_suite(tmp_path: Path) -> None:
    done = _pytest(tmp_path, *LOAD, "--ddp-profile", "ci")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "4 passed" in done.stdout, done.stdout


@pytest.mark.slow
def test_an_unknown_profile_is_a_usage_error(tmp_path: Path) -> None:
    done = _pytest(tmp_path, *LOAD, "--ddp-profile", "fast")
    assert done.returncode == 4, done.stdout + done.stderr
    assert "--ddp-profile='fast': choose one of ci, dev, thorough" in done.stderr


def test_the_entry_point_is_the_plugin_module() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert '[project.entry-points.pytest11]\nddp_reducer = "reducer.testing.plugin"' in text
    assert isinstance(reducer.testing.plugin, types.ModuleType)


def test_all_is_exactly_the_public_names() -> None:
    public = {
        name
        for name in dir(reducer.testing)
        if not name.startswith("_")
        and name != "annotations"
        and not isinstance(getattr(reducer.testing, name), types.ModuleType)
    }
    assert set(reducer.testing.__all__) == public
