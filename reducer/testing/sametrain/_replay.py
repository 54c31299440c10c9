"""The same-training verdict for a training step under test: the W ranks' step and its replay
as one process on the global batch, and the gradients compared, rounding-aware.

``check_same_training`` runs the user's own forward and loss (``loss_fn``) on each rank's
micro-batches, as DDP's ranks would, recording the same evidence as a launch (so the findings
are the same), then replays the step as one process on the concatenation of every rank's
micro-batches and compares the averaged gradient with that process's, parameter by parameter.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ._declared import _checked, declared
from ._evidence import Recorder
from ._findings import Finding, Verdict, _factor, _simple, judge

__all__ = ["check_same_training"]

# The averaged gradient and one process's add the same per-sample terms in another order:
# each may round by about eps per addition. This many eps per micro-batch of the step, times
# the gradient's magnitude, bounds the difference (a mistake is off by a factor, not by eps).
_ROUNDING_EPS = 64


def check_same_training(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], Tensor],
    batches: Sequence[Sequence[Any]],
    *,
    deliberate: Iterable[str] = (),
    raise_on_finding: bool = True,
) -> Verdict:
    """Does one data-parallel step train ``model`` as one process would on the global batch?

    ``batches[r]``: rank r's micro-batches for one optimizer step (a tensor, tuple, list or
    dict each; tensors are concatenated along dim 0 into the global batch). ``loss_fn(model,
    micro_batch)``: the loss your loop backpropagates for a micro-batch (your forward and loss,
    with any ``/ accumulation_steps``). Each rank runs on its own copy of ``model``; dropout
    is off on both sides (random masks would differ anyway). The findings are those of
    ``python -m reducer launch`` (see :mod:`reducer.testing.sametrain`), and a replay: the
    rank average of the gradients against one process's on the concatenated batch (its loss
    scaled back to the loss function's own value), equal within rounding.

    Returns the :class:`~reducer.testing.sametrain.Verdict`; raises AssertionError with its report
    when it is not the same training (``raise_on_finding=False``: return it anyway).
    ``deliberate``: causes declared on purpose (as :func:`reducer.testing.sametrain.deliberate`).
    """
    world = _validated(model, loss_fn, batches)
    chosen = _checked(deliberate, "check_same_training(deliberate=...)") | declared()
    base = copy.deepcopy(model)
    for module in base.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.eval()
    local = threading.local()
    recorder = Recorder(world + 1, lambda: getattr(local, "rank", None))  # rank W: the replay
    replicas = [copy.deepcopy(base) for _ in range(world)]
    single = copy.deepcopy(base)
    for watched in (*replicas, single):
        recorder.watch(watched)
    grads: list[list[Tensor]] = []
    with recorder:
        for rank, replica in enumerate(replicas):
            local.rank = rank
            try:
                for micro in batches[rank]:
                    _scalar(loss_fn(replica, micro), rank).backward()  # type: ignore[no-untyped-call]
            finally:
                local.rank = None
            recorder.end_step(rank)
            grads.append(_grads(replica))
        local.rank = world
        try:
            _scalar(loss_fn(single, _concat([m for r in batches for m in r])), None).backward()  # type: ignore[no-untyped-call]
        finally:
            local.rank = None
    verdict = judge(recorder.ranks[:world], chosen, seeds=False)
    _compare(verdict, recorder, grads, _grads(single), single, len(batches[0]))
    if raise_on_finding and not verdict.same:
        raise AssertionError("check_same_training:\n" + verdict.report())
    return verdict


def _validated(
    model: nn.Module, loss_fn: Callable[[nn.Module, Any], Tensor], batches: Sequence[Sequence[Any]]
) -> int:
    if not isinstance(model, nn.Module):
        raise TypeError(f"check_same_training: model must be an nn.Module, got {type(model)}")
    if not callable(loss_fn):
        raise TypeError("check_same_training: loss_fn must be callable as loss_fn(model, batch)")
    if isinstance(batches, (Tensor, dict)) or len(batches) < 1:
        raise ValueError(
            "check_same_training: batches must hold one list of micro-batches per rank, e.g. "
            "[[(x0, y0)], [(x1, y1)]] for 2 ranks of one micro-batch each"
        )
    counts = [len(b) if isinstance(b, (list, tuple)) else -1 for b in batches]
    if counts[0] < 1 or any(c != counts[0] for c in counts):
        raise ValueError(
            f"check_same_training: batches[r] must be a list of micro-batches, as many for "
            f"every rank (DDP's ranks reduce on the same micro-steps); got {counts} "
            "(-1: not a list)"
        )
    return len(batches)


def _scalar(loss: Any, rank: int | None) -> Tensor:
    if not isinstance(loss, Tensor) or loss.dim() != 0 or not loss.requires_grad:
        who = "the replay" if rank is None else f"rank {rank}"
        raise ValueError(
            f"check_same_training: loss_fn returned {type(loss).__name__} on {who}; it must "
            "return the scalar loss tensor your loop backpropagates"
        )
    return loss


def _grads(model: nn.Module) -> list[Tensor]:
    return [
        torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
        for p in model.parameters()
    ]


def _concat(parts: Sequence[Any]) -> Any:
    first = parts[0]
    if isinstance(first, Tensor):
        return torch.cat([p if p.dim() else p.reshape(1) for p in parts])
    if isinstance(first, (tuple, list)):
        return type(first)(_concat([p[i] for p in parts]) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: _concat([p[k] for p in parts]) for k in first}
    return first  # a plain value (a flag, a count): the same for every micro-batch


def _compare(
    verdict: Verdict,
    recorder: Recorder,
    grads: list[list[Tensor]],
    single: list[Tensor],
    model: nn.Module,
    micro: int,
) -> None:
    """The replay against the averaged gradient, as a note, or a finding if nothing else
    explains the difference."""
    world = len(grads)
    replay = recorder.ranks[world].backwards
    scale = 1.0
    if replay and len(replay[0].losses) == 1 and replay[0].losses[0].value != 0:
        scale = replay[0].value / replay[0].losses[0].value
    one = [g / scale for g in single]
    average = [torch.stack([g[i] for g in grads]).sum(0) / world for i in range(len(single))]
    names = [n for n, _ in model.named_parameters()]
    # The parameter whose difference is largest against its own rounding bound.
    worst, worst_name, bound_at = 0.0, "", 0.0
    for name, a, b in zip(names, average, one, strict=True):
        if not a.numel() or not a.is_floating_point():
            continue
        magnitude = max(float(a.abs().max()), float(b.abs().max()), 1e-30)
        bound = _ROUNDING_EPS * torch.finfo(a.dtype).eps * world * micro * magnitude
        difference = float((a - b).abs().max())
        if not worst_name or difference / bound > worst / bound_at:
            worst, worst_name, bound_at = difference, name, bound
    if worst <= bound_at:
        verdict.notes.append(
            f"replay: the averaged gradient equals one process's on the global batch within "
            f"rounding (largest difference {worst:.3g} in '{worst_name}', bound {bound_at:.3g})"
        )
        return
    dot = sum(float((a * b).sum()) for a, b in zip(average, one, strict=True))
    norm = sum(float((b * b).sum()) for b in one)
    ratio = dot / norm if norm else float("nan")
    what = (
        f"the averaged gradient differs from one process's on the global batch: largest "
        f"difference {worst:.3g} in '{worst_name}' (rounding bound {bound_at:.3g}); "
        f"best fit: {ratio:.4g} x one process's"
    )
    scaled = norm > 0 and all(
        float((a - ratio * b).abs().max()) <= 2 * bound_at + 1e-3 * float(b.abs().max())
        for a, b in zip(average, one, strict=True)
    )
    explained = verdict.findings or verdict.silenced
    if explained:
        verdict.notes.append(f"replay: {what} (explained by the findings above)")
        return
    if scaled and _simple(ratio):
        verdict.findings.append(
            Finding(
                "loss-scale",
                f"each step is {_factor(ratio)} one process's on the global batch (the "
                "averaged gradient is the replay's, scaled)",
                what,
                "backpropagate the mean over the local batch (divided by the accumulation "
                "steps, once)",
            )
        )
        return
    verdict.findings.append(
        Finding(
            "replay-mismatch",
            "the step is not one process's on the global batch, and the recorded evidence does "
            "not say why",
            what,
            "compare loss_fn on the concatenated batch with the ranks' losses: a reduction "
            "over a count other than the batch's, or a batch-dependent layer",
        )
    )
