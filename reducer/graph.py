"""The reducer's ties to the autograd engine: graph search, gradient hooks, end of backward.

A parameter takes part in backward exactly when the graph of the outputs reaches its gradient
accumulator (the ``AccumulateGrad`` node autograd creates once per leaf and reuses while it is
alive). The search walks ``grad_fn.next_functions`` from the outputs; torch's public
``torch.autograd.graph.get_gradient_edge`` gives each parameter's accumulator.

The reducer learns that a gradient is ready from a hook on each parameter
(:func:`attach_ready_hooks`), and runs its finalize when the outermost backward ends
(:func:`at_backward_end`). Everything here that needs torch internals is isolated in one
function, with the reason.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor
from torch.autograd.graph import Node, get_gradient_edge
from torch.utils.hooks import RemovableHandle

__all__: list[str] = []

K = TypeVar("K", bound=Hashable)

# Called at every hook: one global lookup, instead of a module and an attribute.
_grad_enabled = torch.is_grad_enabled


def gradient_accumulator(param: Tensor) -> Node:
    """The node that accumulates ``param``'s gradient.

    The caller must keep the returned node alive: autograd holds it weakly, and would create
    a new one (unknown to the search) for the next graph if it were collected.
    """
    return get_gradient_edge(param).node


def reached_accumulators(outputs: Iterable[Tensor], accumulators: Mapping[Node, K]) -> set[K]:
    """The values of ``accumulators`` whose node the graph of ``outputs`` reaches."""
    stack: list[Node] = []
    for output in outputs:
        if output.grad_fn is not None:
            stack.append(output.grad_fn)
        elif output.requires_grad:  # the output is a leaf itself, a parameter returned as is
            stack.append(gradient_accumulator(output))
    seen: set[Node] = set(stack)
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)
    return {accumulators[node] for node in seen if node in accumulators}


# -------------------------------------------------------------------------------------------
# Gradient hooks.


class HookTarget(Protocol):
    """What the hooks call: the reducer's autograd hook."""

    def _autograd_hook(self, replica_index: int, index: int) -> None: ...


def attach_ready_hooks(
    target: HookTarget, replicas: list[list[Tensor]]
) -> tuple[dict[Node, tuple[int, int]], list[RemovableHandle]]:
    """Call ``target._autograd_hook(r, i)`` after each parameter's gradient is accumulated.

    Returns each parameter's accumulator, mapped to its (replica, index): the caller keeps
    them alive, so that the graph search recognizes them (see :func:`gradient_accumulator`);
    and the hooks' handles. The hooks hold ``target`` weakly, and are removed when it is
    collected: a reducer dropped without close() must not leave hooks on the model.
    """
    accumulators: dict[Node, tuple[int, int]] = {}
    handles: list[RemovableHandle] = []
    this = weakref.ref(target)
    for r, replica in enumerate(replicas):
        for i, param in enumerate(replica):
            accumulators[gradient_accumulator(param)] = (r, i)
            hook = functools.partial(grad_ready_hook, this, r, i)
            # torch leaves this method unannotated.
            handle = param.register_post_accumulate_grad_hook(hook)  # type: ignore[no-untyped-call]
            handles.append(handle)
    weakref.finalize(target, remove_hooks, handles)
    return accumulators, handles


def grad_ready_hook(
    target_ref: weakref.ReferenceType[HookTarget], replica_index: int, index: int, _param: Tensor
) -> None:
    """The hook on each parameter: hands (replica, index) to the reducer."""
    # Through a weak reference: the model must not keep a dropped reducer alive.
    target = target_ref()
    if target is None:
        return
    if _grad_enabled():
        # backward(create_graph=True) runs hooks in grad mode: the reducer's copies and its
        # in-place division of leaf-derived buffers must not be recorded (autograd refuses
        # in-place ops on leaves that require grad). The checked fast path is the usual one.
        with torch.no_grad():
            target._autograd_hook(replica_index, index)
    else:
        target._autograd_hook(replica_index, index)


def remove_hooks(handles: list[RemovableHandle]) -> None:
    """Remove every hook of ``handles`` (and forget them). Idempotent."""
    for handle in handles:
        handle.remove()
    handles.clear()


# -------------------------------------------------------------------------------------------
# The end of backward.

# Note [Finalize at the outermost backward's end]
# The engine runs a queued callback when the *current* graph task ends. A backward started
# inside another one (reentrant activation checkpointing: the checkpoint's backward node runs
# a backward of its own) is a graph task of its own, which ends while the outer backward may
# still produce gradients: finalizing there would take every later gradient of this iteration
# for local accumulation, silently. So a callback that finds itself at the end of a nested
# backward (the engine is still inside the outer backward's node) does not run: it hooks that
# node, and when the node is done, on the outer graph task, queues itself again. It runs once
# the outermost backward ends. A parameter whose hook fires again meanwhile (the same layer in
# two reentrant checkpoints) is then marked ready twice: a loud error, not a wrong gradient.


def at_backward_end(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the outermost backward pass running now ends, on its thread.

    See Note [Finalize at the outermost backward's end]. It must be called from inside
    backward.
    """
    engine: Any = torch.autograd.Variable._execution_engine

    def at_end() -> None:
        outer = _current_autograd_node()
        if outer is None:  # the outermost backward ended
            callback()
            return
        handles: list[RemovableHandle] = []

        def after_outer_node(*_: object) -> None:
            handles.pop().remove()  # once
            at_backward_end(callback)  # now on the outer graph task

        handles.append(outer.register_hook(after_outer_node))

    # torch has no public API to queue a callback at the end of backward: the engine's
    # queue_callback is what torch's own DDP uses.
    engine.queue_callback(at_end)


def _current_autograd_node() -> Node | None:
    """The node whose execution the backward running now is nested in; None at the top.

    torch has no public API for it: ``torch._C._current_autograd_node`` is the only way to
    tell a nested backward's end from the outermost one's (see Note [Finalize at the
    outermost backward's end]), so it is isolated here.
    """
    node: Node | None = torch._C._current_autograd_node()
    return node


def is_future(value: object) -> bool:
    """A torch future: ``torch.futures.Future``, or what its ``then`` returns.

    ``Future.then`` returns the C++ future that the Python class wraps, not an instance of
    the Python class, and torch has no public name for that type; so the check is on it.
    """
    return isinstance(value, torch._C.Future)
