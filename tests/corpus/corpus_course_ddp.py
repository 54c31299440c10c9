"""Hand-written DDP wrappers of the kind systems courses ask for, each with a known bug and
its fix.

Source: the interface of stanford-cs336 assignment 2 ("systems"): a wrapper built from a
module, ``forward``, and ``finish_gradient_synchronization()`` called after backward, as
radi-cho/cs336-a2 implements it in ``cs336_systems/ddp.py`` (commit a9b851d34f68): one
asynchronous ``all_reduce`` per parameter from a post-accumulate-grad hook, waited for and
divided by the world size in ``finish_gradient_synchronization()``; and a bucketed variant
(buckets of ``bucket_size_mb``, each reduced when its last gradient is ready). Re-written
here on the process group the check hands the factory; the bugs are the ones such wrappers
are known for:

- :class:`AveragesParameters`: ``finish_gradient_synchronization()`` reduces ``p.data``
  instead of ``p.grad``: the parameters are averaged, every gradient stays local.
- :class:`DividesBeforeWaiting`: divides each gradient before waiting for its allreduce
  (a race; checked once the checks take a controlled schedule).
- ``last_bucket_only``: the hooks are made in a loop by a closure over the loop's
  ``bucket`` variable, so every hook counts towards, and fills, the last bucket
  (Python's late binding); the fix binds the bucket when the hook is made.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

import reducer


class IndividualParameters(nn.Module):
    """One async allreduce per parameter from its post-accumulate-grad hook; waited for and
    divided in ``finish_gradient_synchronization()`` (the fixed version)."""

    def __init__(self, module: nn.Module, pg: reducer.ProcessGroup) -> None:
        super().__init__()
        self.module, self.pg = module, pg
        self.pending: list[tuple[Any, Tensor]] = []
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(self._launch)  # type: ignore[no-untyped-call]

    def _launch(self, p: Tensor) -> None:
        assert p.grad is not None
        self.pending.append((self.pg.allreduce([p.grad]), p))

    def forward(self, *args: Any) -> Any:
        return self.module(*args)

    def finish_gradient_synchronization(self) -> None:
        for work, p in self.pending:
            work.wait()
            assert p.grad is not None
            p.grad.div_(self.pg.size())
        self.pending.clear()


class AveragesParameters(IndividualParameters):
    """The bug: reduces the parameters' values where it should reduce their gradients."""

    def _launch(self, p: Tensor) -> None:
        self.pending.append((self.pg.allreduce([p.data]), p))

    def finish_gradient_synchronization(self) -> None:
        for work, p in self.pending:
            work.wait()
            p.data.div_(self.pg.size())
        self.pending.clear()


class Bucketed(nn.Module):
    """Buckets of consecutive parameters (in reverse, the order backward produces them), each
    flattened and reduced when its last gradient is ready; unflattened back in
    ``finish_gradient_synchronization()``. ``late_binding=True`` is the bug."""

    def __init__(
        self,
        module: nn.Module,
        pg: reducer.ProcessGroup,
        bucket_size_mb: float = 3e-5,
        late_binding: bool = False,
    ) -> None:
        super().__init__()
        self.module, self.pg = module, pg
        self.buckets: list[list[Tensor]] = [[]]
        size = 0
        for p in reversed(list(module.parameters())):
            if self.buckets[-1] and size + p.numel() * p.element_size() > bucket_size_mb * 2**20:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self.ready = [0] * len(self.buckets)
        self.pending: list[tuple[Any, Tensor, list[Tensor]]] = []
        for index, bucket in enumerate(self.buckets):
            for p in bucket:
                if late_binding:  # the bug: `index` is read when the hook runs: the last one
                    hook: Callable[[Tensor], None] = lambda _p: self._ready(index)  # noqa: E731, B023
                else:
                    hook = self._hook_for(index)
                p.register_post_accumulate_grad_hook(hook)  # type: ignore[no-untyped-call]

    def _hook_for(self, index: int) -> Callable[[Tensor], None]:
        return lambda _p: self._ready(index)

    def _ready(self, index: int) -> None:
        self.ready[index] += 1
        if self.ready[index] == len(self.buckets[index]):
            grads = [p.grad.reshape(-1) for p in self.buckets[index] if p.grad is not None]
            if not grads:
                return
            flat = torch.cat(grads)
            self.pending.append((self.pg.allreduce([flat]), flat, self.buckets[index]))

    def forward(self, *args: Any) -> Any:
        self.ready = [0] * len(self.buckets)
        return self.module(*args)

    def finish_gradient_synchronization(self) -> None:
        for work, flat, bucket in self.pending:
            work.wait()
            flat.div_(self.pg.size())
            offset = 0
            for p in bucket:
                assert p.grad is not None
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        self.pending.clear()


def last_bucket_only(module: nn.Module, pg: reducer.ProcessGroup) -> nn.Module:
    return Bucketed(module, pg, late_binding=True)


def bucketed(module: nn.Module, pg: reducer.ProcessGroup) -> nn.Module:
    return Bucketed(module, pg)


class DividesBeforeWaiting(IndividualParameters):
    """The race: divides each gradient while its asynchronous allreduce may still be reading
    it (the division belongs after ``wait()``). Whether the reduction sees the divided or
    the undivided gradient depends on when the collective reads its input: a race, which
    only a controlled scheduler makes repeatable."""

    def finish_gradient_synchronization(self) -> None:
        for work, p in self.pending:
            assert p.grad is not None
            p.grad.div_(self.pg.size())  # the bug: before work.wait()
            work.wait()
        self.pending.clear()
