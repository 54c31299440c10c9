"""The scenarios' own strategies draw what they promise.

A strategy that never draws a case hides every bug of that case from the properties built
on it: ``odd_heavy_world_sizes`` must reach every world size from 1 to its maximum and
shrink to one rank (a bug that needs only one rank is then reported at one rank).
"""

from __future__ import annotations

import pytest
from hypothesis import find, settings
from hypothesis.errors import NoSuchExample

from reducer.testing.strategies import odd_heavy_world_sizes

_SEARCH = settings(database=None, max_examples=200)


@pytest.mark.parametrize("max_size", [3, 4, 6])
def test_odd_heavy_world_sizes_reach_every_size_and_shrink_to_one(max_size: int) -> None:
    sizes = odd_heavy_world_sizes(max_size)
    assert find(sizes, lambda w: True, settings=_SEARCH) == 1
    for size in range(1, max_size + 1):
        assert find(sizes, lambda w, size=size: w == size, settings=_SEARCH) == size
    with pytest.raises(NoSuchExample):
        find(sizes, lambda w: not 1 <= w <= max_size, settings=_SEARCH)
