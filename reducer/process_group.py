"""The process-group protocol that the reducer is written against.

Three things implement it: the in-memory threaded world (``fakepg``), and torch.distributed's
gloo and NCCL backends through :class:`reducer.TorchProcessGroup`. The reducer depends on
nothing but what is written here, so this module imports no ``torch.distributed``.

The contract, which every implementation keeps:

* **In place.** ``allreduce`` and ``broadcast`` write their result into the tensors they were
  given; ``allgather`` writes into the output lists. ``Work.result()`` returns those tensors
  (for a sparse allreduce, the reduced sparse tensor, one per input).
* **Asynchronous.** A collective returns a :class:`Work` at once. The inputs must not be
  touched until ``Work.wait()`` returns; the caller may compute anything else meanwhile. This
  is what lets the reducer overlap communication with the rest of backward.
* **Ordered.** Collectives are matched across ranks by the order in which each rank issues
  them: the k-th collective of every rank is one collective. Every rank must issue the same
  sequence (same kind, op, tensor count, dtypes and shapes).
* **Errors surface in** ``wait``. A collective that fails (a peer failed, a peer called a
  different collective, the timeout passed) raises from ``Work.wait`` on every rank that waits
  for it. Invalid local arguments raise ``ValueError`` from the call itself.
"""

from __future__ import annotations

import enum
from typing import Protocol, runtime_checkable

from torch import Tensor

__all__ = ["ProcessGroup", "ReduceOp", "Work"]


class ReduceOp(enum.Enum):
    """How ``allreduce`` combines the tensors of all ranks, element-wise.

    ``AVG`` is the sum divided by the number of contributions (ranks times tensors per rank),
    so a multi-tensor allreduce averages over every tensor of every rank, as NCCL does when
    each tensor is its own participant.
    """

    SUM = "sum"
    AVG = "avg"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"

    def __repr__(self) -> str:
        return f"ReduceOp.{self.name}"


@runtime_checkable
class Work(Protocol):
    """A handle on one rank's part of an asynchronous collective."""

    def wait(self, timeout: float | None = None) -> None:
        """Block until the collective is complete on this rank.

        Raises the collective's error, if it failed, every time it is called. ``timeout`` is
        in seconds; ``None`` means the group's default timeout. Passing it raises an error
        (a ``TimeoutError`` subclass for the fake world) that names the collective.
        """
        ...

    def is_completed(self) -> bool:
        """True once the collective finished on this rank, successfully or not. Never blocks."""
        ...

    def result(self) -> list[Tensor]:
        """The output tensors, valid after ``wait`` returned.

        For ``allreduce`` and ``broadcast`` these are the input tensors, now holding the
        result; for a sparse allreduce, the reduced (coalesced) sparse tensor, one per input.
        """
        ...


@runtime_checkable
class ProcessGroup(Protocol):
    """One rank's view of a group of ``size()`` ranks that run collectives together.

    Every method issues the next collective of this rank (see the module docstring for the
    ordering rule) and returns its :class:`Work` without waiting for the other ranks.
    """

    def rank(self) -> int:
        """This rank's index, ``0 <= rank() < size()``."""
        ...

    def size(self) -> int:
        """The number of ranks in the group."""
        ...

    def allreduce(self, tensors: list[Tensor], op: ReduceOp = ReduceOp.SUM) -> Work:
        """Reduce ``tensors`` of every rank element-wise and write the result into each.

        All tensors of the list (one per model replica in the reducer's multi-replica mode)
        take part: the result combines every tensor of every rank and is written into every
        one of them. Tensors are dense and contiguous, or all sparse COO.
        """
        ...

    def allgather(self, output_lists: list[list[Tensor]], inputs: list[Tensor]) -> Work:
        """Gather ``inputs[i]`` of every rank ``r`` into ``output_lists[i][r]``."""
        ...

    def broadcast(self, tensors: list[Tensor], root: int) -> Work:
        """Copy rank ``root``'s ``tensors[i]`` into ``tensors[i]`` of every other rank."""
        ...

    def barrier(self) -> Work:
        """Complete once every rank has issued this barrier."""
        ...
