"""reducer: PyTorch's DDP gradient reducer in Python, against an abstract process group."""

from __future__ import annotations

from .errors import ReducerError
from .process_group import ProcessGroup, ReduceOp, Work

__all__ = ["ProcessGroup", "ReduceOp", "ReducerError", "Work"]
