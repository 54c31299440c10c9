"""Which parameters an autograd graph reaches: the search behind unused-parameter detection.

A parameter takes part in backward exactly when the graph of the outputs reaches its gradient
accumulator (the ``AccumulateGrad`` node autograd creates once per leaf and reuses while it is
alive). The search walks ``grad_fn.next_functions`` from the outputs; torch's public
``torch.autograd.graph.get_gradient_edge`` gives each parameter's accumulator.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from typing import TypeVar

from torch import Tensor
from torch.autograd.graph import Node, get_gradient_edge

__all__: list[str] = []

K = TypeVar("K", bound=Hashable)


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
