"""Data-parallel wrappers written as published course and blog implementations write them,
each with a race between a rank and its in-flight collective, and its fix.

The shape is stanford-cs336 assignment 2's (``DDPIndividualParameters``,
``DDPBucketed``): the constructor broadcasts every parameter from rank 0 with
``dist.broadcast``, post-accumulate-grad hooks issue asynchronous ``dist.all_reduce`` calls
(one per parameter, or one per bucket of a persistent flat buffer), and the training loop
calls ``finish_gradient_synchronization()`` before ``optimizer.step()``. Each race below is
harmless whenever the collective finishes quickly, which on two gloo processes with small
tensors is nearly always: each fails only under some orders.

- :class:`DividesBeforeWaiting`: ``finish`` divides each ``.grad`` by the world size while
  its async SUM all_reduce may still read it (fix: wait, then divide).
- :class:`DividesInHook`: the hook issues the SUM all_reduce of ``.grad`` and divides it at
  once (fix: divide, then issue).
- :class:`BucketRewritten`: a bucket's flat buffer is refilled by the next micro-batch's
  backward while the previous all_reduce of that buffer may be in flight, when two
  micro-batches run before one ``finish`` (fix: wait for the bucket's last all_reduce first).
- :class:`CopiesBackBeforeWaiting`: ``finish`` copies each bucket's buffer back into the
  gradients, then waits (fix: wait, then copy back).
- :func:`divide_in_flight_hook`: a comm hook for torch's DDP that issues the all_reduce of
  the bucket and divides the bucket while it is in flight (fix: divide first).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn


class _Published(nn.Module):
    """The constructor every such wrapper starts with: rank 0's parameters everywhere."""

    def __init__(self, module: nn.Module, pg: object = None) -> None:
        super().__init__()
        self.module = module
        for p in module.parameters():
            dist.broadcast(p.data, src=0)
        self.handles: list[tuple[Any, Tensor]] = []

    def forward(self, *args: Any) -> Any:
        return self.module(*args)


class IndividualParameters(_Published):
    """One async SUM all_reduce per gradient, from its post-accumulate-grad hook; ``finish``
    waits for each, then divides (the fix of :class:`DividesBeforeWaiting`)."""

    def __init__(self, module: nn.Module, pg: object = None) -> None:
        super().__init__(module, pg)
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(self._hook)  # type: ignore[no-untyped-call]

    def _hook(self, p: Tensor) -> None:
        assert p.grad is not None
        self.handles.append((dist.all_reduce(p.grad, async_op=True), p.grad))

    def finish_gradient_synchronization(self) -> None:
        for handle, grad in self.handles:
            handle.wait()
            grad.div_(dist.get_world_size())
        self.handles.clear()


class DividesBeforeWaiting(IndividualParameters):
    def finish_gradient_synchronization(self) -> None:
        for handle, grad in self.handles:
            grad.div_(dist.get_world_size())  # the race: the all_reduce may not have read it
            handle.wait()
        self.handles.clear()


class DividesInHook(IndividualParameters):
    def _hook(self, p: Tensor) -> None:
        assert p.grad is not None
        handle = dist.all_reduce(p.grad, async_op=True)
        p.grad.div_(dist.get_world_size())  # the race: divides what is being summed
        self.handles.append((handle, p.grad))

    def finish_gradient_synchronization(self) -> None:
        for handle, _grad in self.handles:
            handle.wait()
        self.handles.clear()


class DividesFirstInHook(DividesInHook):
    """The fix of :class:`DividesInHook`: divide, then issue the SUM."""

    def _hook(self, p: Tensor) -> None:
        assert p.grad is not None
        p.grad.div_(dist.get_world_size())
        self.handles.append((dist.all_reduce(p.grad, async_op=True), p.grad))


class Bucketed(_Published):
    """Buckets of consecutive parameters (in reverse), each with a persistent flat buffer:
    when a bucket's last gradient is ready, its gradients are copied into the buffer and the
    buffer's async SUM all_reduce is issued; ``finish`` waits for each, divides the buffer
    and copies it back into the gradients."""

    def __init__(self, module: nn.Module, pg: object = None, bucket_size_mb: float = 5e-5) -> None:
        super().__init__(module, pg)
        self.buckets: list[list[nn.Parameter]] = [[]]
        for p in reversed(list(module.parameters())):
            size = sum(q.numel() * q.element_size() for q in self.buckets[-1])
            if self.buckets[-1] and size + p.numel() * p.element_size() > bucket_size_mb * 2**20:
                self.buckets.append([])
            self.buckets[-1].append(p)
        self.buffers_ = [torch.zeros(sum(p.numel() for p in b)) for b in self.buckets]
        self.ready = [0] * len(self.buckets)
        self.pending: dict[int, Any] = {}
        for index, bucket in enumerate(self.buckets):
            for p in bucket:
                p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                    lambda _p, index=index: self._ready(index)
                )

    def _fill(self, index: int) -> None:
        grads = [p.grad.reshape(-1) for p in self.buckets[index] if p.grad is not None]
        self.buffers_[index].copy_(torch.cat(grads))

    def _ready(self, index: int) -> None:
        self.ready[index] += 1
        if self.ready[index] % len(self.buckets[index]) == 0:
            self._fill(index)
            self.pending[index] = dist.all_reduce(self.buffers_[index], async_op=True)

    def _copy_back(self, index: int) -> None:
        offset = 0
        for p in self.buckets[index]:
            assert p.grad is not None
            p.grad.copy_(self.buffers_[index][offset : offset + p.numel()].view_as(p.grad))
            offset += p.numel()

    def finish_gradient_synchronization(self) -> None:
        for index, handle in self.pending.items():
            handle.wait()
            self.buffers_[index].div_(dist.get_world_size())
            self._copy_back(index)
        self.pending.clear()


class BucketRewritten(Bucketed):
    """Each synced micro-batch issues its buckets' all_reduce; the next one refills the
    buffers without waiting (the race), and ``finish`` waits only for the last handles."""


class WaitsBeforeRefilling(Bucketed):
    """The fix of :class:`BucketRewritten`: wait for a bucket's last all_reduce before its
    buffer is refilled."""

    def _fill(self, index: int) -> None:
        handle = self.pending.pop(index, None)
        if handle is not None:
            handle.wait()
        super()._fill(index)


class CopiesBackBeforeWaiting(Bucketed):
    def finish_gradient_synchronization(self) -> None:
        for index, handle in self.pending.items():
            self._copy_back(index)  # the race: the reduced values may not have landed
            handle.wait()
            for p in self.buckets[index]:
                assert p.grad is not None
                p.grad.div_(dist.get_world_size())
        self.pending.clear()


class CopiesBackAfterWaiting(Bucketed):
    """The fix of :class:`CopiesBackBeforeWaiting`: wait, copy back, divide."""

    def finish_gradient_synchronization(self) -> None:
        for index, handle in self.pending.items():
            handle.wait()
            self._copy_back(index)
            for p in self.buckets[index]:
                assert p.grad is not None
                p.grad.div_(dist.get_world_size())
        self.pending.clear()


# torch's DDP reads a hook's annotations: these hooks have none.
def divide_in_flight_hook(state, bucket):  # type: ignore[no-untyped-def]
    buffer = bucket.buffer()
    future = dist.all_reduce(buffer, async_op=True).get_future()
    buffer.div_(dist.get_world_size())  # the race: the all_reduce may not have read it
    return future.then(lambda f: f.value()[0])


def divide_first_hook(state, bucket):  # type: ignore[no-untyped-def]
    buffer = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])
