"""Accelerate's state pattern: every instance shares one class-level dict (its ``__dict__``),
so all instances in a process are one state, set up by the first. On rank threads, unless the
launch makes that dict per thread, the second rank finds the first rank's half-built state: a
missing attribute, or the first rank's index."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.distributed as dist


class PartialState:
    _shared_state: ClassVar[dict[str, Any]] = {}  # the point: one per process

    def __init__(self) -> None:
        self.__dict__ = self._shared_state
        if not self.initialized:
            self.backend = "gloo"
            if not dist.is_initialized():
                dist.init_process_group(self.backend)
            self.num_processes = dist.get_world_size()
            self.process_index = dist.get_rank()
            self.device = torch.device("cpu")

    @property
    def initialized(self) -> bool:
        return self._shared_state != {}


class AcceleratorState:
    _shared_state: ClassVar[dict[str, Any]] = {}  # the point: one per process

    def __init__(self) -> None:
        self.__dict__ = self._shared_state
        if self._shared_state == {}:
            self.partial = PartialState()
            self.process_index = self.partial.process_index
