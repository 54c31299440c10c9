"""``Accelerator``: the state behind it is one per process (see state.py)."""

from __future__ import annotations

from .state import AcceleratorState


class Accelerator:
    def __init__(self) -> None:
        self.state = AcceleratorState()

    @property
    def process_index(self) -> int:
        return int(self.state.process_index)
