"""The data-parallel invariants at one optimizer step, judged on every rank's tensors at once.

Before the step: the parameters and the gradients are bit-identical on every rank; if the
gradients differ, why (see :func:`_why_not_reduced`); where a wrapper reduced them, each is the
exact rank-order average of the ranks' local gradients, ``sum_r(g_r * (1/W))`` added in
ascending rank order as torch's DDP and the fake world compute it (see
:func:`_check_average`); more than one reduction of a wrapper between two steps is waste.
After the step: the parameters are bit-identical; buffers that differ are a note.

# Guarantees: every function here runs on one thread (the rendezvous' judge) while every rank
# waits at the step, so no rank's tensors change under it.
"""

from __future__ import annotations

import gc
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from reducer._averages import (
    average,
    averages,
    bits,
    bits_equal,
    explain,
    host,
    max_diff,
    rank_order_sum,
)

from ._record import REDUCTIONS, Forward, RankRecord, storage, wrapper_types

__all__: list[str] = []


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing the check found. ``level``: "error" (the ranks diverged or a reduction is
    wrong: the run fails), "warning" (waste) or "note" (legitimate but worth knowing)."""

    level: str
    step: int
    title: str
    text: str
    key: str  # warnings and notes with the same key are shown once


@dataclass(slots=True)
class Arrival:
    """What a rank brings to the step: its optimizer's parameters and its record."""

    rank: int
    step: int
    line: str  # the script line that called optimizer.step()
    params: list[Tensor]
    record: RankRecord
    ignored: frozenset[int] = frozenset()  # ids of what a wrapper ignores (see RankRecord)


@dataclass(slots=True)
class Audit:
    findings: list[Finding]
    compared: int  # parameters compared on every rank
    sharded: int  # parameters sharded across ranks (not replicas: not compared)
    ignored: int = 0  # parameters a wrapper ignores (not compared)


# -------------------------------------------------------------------------------------------
# Before the step.


def before_step(arrivals: Sequence[Arrival]) -> Audit:
    audit = _before_step(arrivals)
    first = arrivals[0]
    if first.ignored:
        wrappers = first.record.wrappers.values()
        params = {id(p) for w in wrappers for p in w.parameters()}
        audit.ignored = len(params & first.ignored)
    return audit


def _before_step(arrivals: Sequence[Arrival]) -> Audit:
    first = arrivals[0]
    step, line = first.step, first.line
    shapes = [[tuple(p.shape) for p in a.params] for a in arrivals]
    if any(s != shapes[0] for s in shapes):
        counts = ", ".join(f"rank {a.rank}: {len(a.params)}" for a in arrivals)
        text = (
            f"optimizer step {step} ({line}): the ranks step different parameters ({counts}), "
            "or parameters of different shapes: a sharded optimizer? Not compared."
        )
        return Audit([Finding("note", step, "different parameters", text, f"shapes@{line}")], 0, 0)
    # See Note [All parameters at once].
    replicas = [[_replica(p) for p in a.params] for a in arrivals]
    idx = [i for i in range(len(first.params)) if all(r[i] is not None for r in replicas)]
    if not _agree([[r[i] for i in idx] for r in replicas]):  # type: ignore[misc]
        return _first_difference(arrivals)
    grads = [[_replica_grad(a.params[i]) for i in idx] for a in arrivals]
    some = [k for k in range(len(idx)) if any(g[k] is not None for g in grads)]
    present = [k for k in some if all(g[k] is not None for g in grads)]
    if len(present) != len(some) or not _agree([[g[k] for k in present] for g in grads]):  # type: ignore[misc]
        return _first_difference(arrivals)
    findings: list[Finding] = []
    cases = []
    for k in present:
        case = _average_case(arrivals, idx[k])
        if isinstance(case, Finding):
            if not any(f.key == case.key for f in findings):
                findings.append(case)
        elif case is not None:
            cases.append(case)
    if not _averages_agree(cases, len(arrivals)):
        names = _names(first.record)
        for k in present:
            i = idx[k]
            name = names.get(
                id(first.params[i]), f"parameter {i} (shape {list(first.params[i].shape)})"
            )
            wrong = _check_average(arrivals, i, name, f"before optimizer step {step} ({line})")
            if wrong is not None and not any(f.key == wrong.key for f in findings):
                findings.append(wrong)
            if wrong is not None and wrong.level == "error":
                return Audit(findings, len(idx), len(first.params) - len(idx))
    findings.extend(_waste(arrivals))
    return Audit(findings, len(idx), len(first.params) - len(idx))


# Note [All parameters at once]
# Comparing parameter by parameter costs a few torch calls per parameter and rank, with every
# rank waiting; so the check first compares each rank's parameters (then gradients, then
# averages) as one buffer of bytes, made of all of them, against rank 0's, and looks at them
# one by one only when those differ, to name the first. The averages are elementwise, so
# computing them over the concatenated gradients gives the same bits as one by one.


def _agree(per_rank: Sequence[Sequence[Tensor]]) -> bool:
    """Whether every rank's tensors are bit-identical to rank 0's, all at once."""
    if not per_rank or not per_rank[0]:
        return True
    blobs = [torch.cat([bits(t) for t in tensors]) for tensors in per_rank]
    return all(b.shape == blobs[0].shape and bool(torch.equal(b, blobs[0])) for b in blobs[1:])


def _averages_agree(cases: list[tuple[int, list[Tensor], Tensor]], world: int) -> bool:
    """Whether every case's gradient is the product-form average (sum of g_r * (1/W)), all
    cases of a dtype at once. False means: look one by one."""
    by_dtype: dict[torch.dtype, list[tuple[int, list[Tensor], Tensor]]] = {}
    for case in cases:
        by_dtype.setdefault(case[2].dtype, []).append(case)
    scale = 1.0 / world
    for group in by_dtype.values():
        ranks = [torch.cat([c[1][r].reshape(-1) for c in group]) for r in range(world)]
        got = torch.cat([c[2].reshape(-1) for c in group])
        if not bits_equal(rank_order_sum([g * scale for g in ranks]), got):
            return False
    return True


def _first_difference(arrivals: Sequence[Arrival]) -> Audit:
    """The parameters one by one, up to the first that differs (see before_step)."""
    first = arrivals[0]
    step, line = first.step, first.line
    names = _names(first.record)
    findings: list[Finding] = []
    compared = sharded = 0
    for i, param in enumerate(first.params):
        values = _present([_replica(a.params[i]) for a in arrivals])
        if values is None:
            sharded += 1
            continue
        compared += 1
        name = names.get(id(param), f"parameter {i} (shape {list(param.shape)})")
        where = f"before optimizer step {step} ({line})"
        differ = _differ(values)
        if differ:
            text = (
                f"parameter {name!r} differs {where}: {_ranks_text(differ, values)}.\n"
                f"  {_why_params_differ(step, param)}"
            )
            findings.append(Finding("error", step, "parameters differ", text, name))
            return Audit(findings, compared, sharded)
        maybe = [_replica_grad(a.params[i]) for a in arrivals]
        if all(g is None for g in maybe):
            continue
        grads = _present(maybe)
        if grads is None:
            missing = [a.rank for a, g in zip(arrivals, maybe, strict=True) if g is None]
            have = [a.rank for a, g in zip(arrivals, maybe, strict=True) if g is not None]
            text = (
                f"gradient of {name!r} differs {where}: ranks {missing} have none, ranks "
                f"{have} have one.\n  {_why_not_reduced(arrivals, i)}"
            )
            findings.append(Finding("error", step, "gradients differ", text, name))
            return Audit(findings, compared, sharded)
        differ = _differ(grads)
        if differ:
            text = (
                f"gradient of {name!r} differs {where}: {_ranks_text(differ, grads)}.\n"
                f"  {_why_not_reduced(arrivals, i)}"
            )
            findings.append(Finding("error", step, "gradients differ", text, name))
            return Audit(findings, compared, sharded)
        wrong = _check_average(arrivals, i, name, where)
        if wrong is not None:
            findings.append(wrong)
            if wrong.level == "error":
                return Audit(findings, compared, sharded)
    findings.extend(_waste(arrivals))
    return Audit(findings, compared, sharded)


def _why_params_differ(step: int, param: Tensor) -> str:
    if not param.requires_grad:
        return (
            "It is frozen (requires_grad=False): no reduction and no optimizer step changes it, "
            "so something changed it on some ranks only, after the wrapper broadcast rank 0's "
            "parameters when it was built (weights loaded on rank 0 only, after wrapping?). "
            "Load them on every rank, or before wrapping the model."
        )
    if step == 0:
        return (
            "The ranks' models started different: DistributedDataParallel broadcasts rank 0's "
            "parameters when it is built; without a wrapper, broadcast them or seed every rank "
            "alike before building the model."
        )
    return "They were identical after the previous step: something changed them in between."


def _owned(wrapper: nn.Module, param: Tensor) -> bool:
    """Whether ``wrapper`` reduces ``param``'s gradient (it holds it and does not ignore it)."""
    cache: dict[int, bool] | None = getattr(wrapper, "_replica_check_owns", None)
    if cache is None:
        cache = {}
        ignored = set(getattr(wrapper, "parameters_to_ignore", ()) or ())
        for name, p in wrapper.named_parameters():
            short = name.removeprefix("module.")
            cache[id(p)] = short not in ignored and name not in ignored
        object.__setattr__(wrapper, "_replica_check_owns", cache)
    return cache.get(id(param), False)


def _governing(record: RankRecord, param: Tensor) -> tuple[list[Forward], bool]:
    """The forwards of wrappers that hold ``param`` since the last step, and whether its
    gradient was reduced after autograd last accumulated it: by a synced forward of such a
    wrapper at or after the micro-step of that accumulation, or by a reducing collective over
    the gradient's storage issued after it."""
    forwards = [f for f in record.forwards if _owned(f.wrapper, param)]
    local = record.local.get(id(param))
    accumulated_at = local[1] if local is not None else None
    if accumulated_at is None:
        reduced = any(f.synced for f in forwards)
    else:
        before = [f for f in forwards if f.clock < accumulated_at]
        start = before[-1].clock if before else 0
        reduced = any(f.synced for f in forwards if f.clock >= start)
    grad_storage = storage(param.grad)
    if not reduced and grad_storage:
        since = accumulated_at or 0
        reduced = any(
            c.kind in REDUCTIONS and grad_storage in c.storages and c.clock > since
            for c in record.collectives
        )
    return forwards, reduced


def _why_not_reduced(arrivals: Sequence[Arrival], i: int) -> str:
    """Why the ranks' gradients of parameter ``i`` differ, as precisely as the records say."""
    per_rank = [_governing(a.record, a.params[i]) for a in arrivals]
    reduced = [a.rank for a, (_, r) in zip(arrivals, per_rank, strict=True) if r]
    not_reduced = [a.rank for a, (_, r) in zip(arrivals, per_rank, strict=True) if not r]
    if reduced and not_reduced:
        causes = "; ".join(
            f"rank {a.rank}: {_unsynced_cause(fs, a.record)}"
            for a, (fs, r) in zip(arrivals, per_rank, strict=True)
            if not r
        )
        return (
            f"Only some ranks reduced it: ranks {reduced} did, ranks {not_reduced} did not "
            f"({causes}). Every rank must take part in the same reductions."
        )
    if not_reduced:
        forwards = [fs for fs, _ in per_rank]
        if not any(forwards):
            wrapper = _wrapper_holding(arrivals[0].params[i])
            if wrapper is not None:
                kind = type(wrapper).__module__ + "." + type(wrapper).__qualname__
                return (
                    f"No reduction touched it since the last step: the {kind} that holds it "
                    "never ran its forward (the loss went through `.module(...)` or a "
                    "submodule, around the wrapper), so no reduction was armed. Call the "
                    "wrapper itself: `ddp(x)`, not `ddp.module(x)`."
                )
            count = sum(1 for c in arrivals[0].record.collectives if c.kind in REDUCTIONS)
            return (
                "No reduction touched it since the last step: no data-parallel wrapper holds "
                f"it, and none of the {count} reduction(s) rank 0 issued was over its "
                "gradient. Reduce it (all_reduce its .grad) or wrap the model."
            )
        if all(_reduced_too_early(a.record, a.params[i]) for a in arrivals):
            return (
                "The wrapper's reduction ran before this gradient's last accumulation, on every "
                "rank: the micro-batches' forwards ran first (a synced one among them) and "
                "their backwards later, so the reduction armed by the synced forward fired "
                "during another micro-batch's backward, and what was accumulated after it was "
                "never reduced. Run each micro-batch's forward and backward together, the "
                "synced one last."
            )
        distinct = {
            _unsynced_cause(fs, a.record) for a, (fs, _) in zip(arrivals, per_rank, strict=True)
        }
        return (
            "No reduction touched it since the last step: "
            + "; ".join(sorted(distinct))
            + ". The micro-step before optimizer.step() must run synced."
        )
    # Every rank reduced, yet they differ.
    unchanged = all(
        (local := a.record.local.get(id(a.params[i]))) is not None
        and local[0] is not None
        and bits_equal(local[0], a.params[i].grad)  # type: ignore[arg-type]
        for a in arrivals
    )
    if not unchanged:
        world = len(arrivals)
        scaled = all(
            (local := a.record.local.get(id(a.params[i]))) is not None
            and local[0] is not None
            and bits_equal(local[0] * (1.0 / world), a.params[i].grad)  # type: ignore[arg-type]
            for a in arrivals
        )
        if scaled:
            return (
                "A wrapper ran synced on every rank, and on every rank this gradient is its "
                f"local gradient times 1/{world}: it was divided but never reduced across ranks "
                "(a dropped bucket)."
            )
    if unchanged:
        starved = _no_gradient(arrivals, i)
        if starved:
            return (
                "A wrapper ran synced on every rank, but this gradient was not reduced: on every "
                f"rank it is still the local gradient. {starved}: their buckets never became "
                "ready, so no reduction launched. Construct the wrapper with "
                "find_unused_parameters=True (or static_graph=True), or use every parameter."
            )
        hooks = {
            h
            for a in arrivals
            for f in _governing(a.record, a.params[i])[0]
            if (h := _comm_hook(f.wrapper))
        }
        if hooks:
            return (
                "A wrapper ran synced on every rank, but this gradient was not reduced: on every "
                f"rank it is still the local gradient. The comm hook {', '.join(sorted(hooks))} "
                "returned its bucket unreduced (a dropped bucket)."
            )
        return (
            "A wrapper ran synced on every rank, but this gradient was not reduced: on every "
            "rank it is still the local gradient. The reducer never averaged it (a comm hook "
            "that returned its bucket unreduced, or a gradient the reducer did not see, as "
            "with activation checkpointing that runs a layer's backward outside the reducer's "
            "hooks)."
        )
    mixed = _mixed_reduction(arrivals, i)
    if mixed is not None:
        return mixed
    return (
        "Every rank reduced it, yet the ranks' gradients differ, and the check cannot tell "
        "why: its gradient is not an average of the ranks' local gradients of any parameters "
        "it knows. Something may have changed it after the reduction, differently per rank "
        "(a gradient hook, per-rank clipping or scaling), or a comm hook returned "
        "rank-dependent values."
    )


_MAX_PAIRINGS = 4096  # parameter combinations tried to explain a gradient (see below)


def _mixed_reduction(arrivals: Sequence[Arrival], i: int) -> str | None:
    """Proof that a reduction summed different parameters across ranks: on some rank, the
    gradient of parameter ``i`` is bit for bit the rank-order average of the ranks' local
    gradients of parameters that are not all ``i`` (each rank's collective was over another
    bucket of the same size). None when no such combination is found."""
    world = len(arrivals)
    for a in arrivals:
        got = a.params[i].grad
        if got is None or got.is_sparse:
            continue
        got = host(got)
        candidates = local_gradients_like(arrivals, got)
        total = math.prod(len(found) for found in candidates)
        if total == 0 or total > _MAX_PAIRINGS:
            continue
        for combo in itertools.product(*candidates):
            if all(param is b.params[i] for (param, _), b in zip(combo, arrivals, strict=True)):
                continue
            grads = [g for _, g in combo]
            candidates_of_combo = averages(grads, world).values()
            if any(v is not None and bits_equal(v, got) for v in candidates_of_combo):
                return _mixed_text(arrivals, a, i, [param for param, _ in combo])
    return None


def local_gradients_like(
    arrivals: Sequence[Arrival], got: Tensor
) -> list[list[tuple[Tensor, Tensor]]]:
    """Per rank, its parameters whose local gradient (on the host) has ``got``'s shape and
    dtype: what a reduction that gave ``got`` could have summed."""
    return [
        [
            (param, host(local[0]))
            for key, param in b.record.accumulated.items()
            if (local := b.record.local.get(key)) is not None
            and local[0] is not None
            and not local[0].is_sparse
            and local[0].shape == got.shape
            and local[0].dtype == got.dtype
        ]
        for b in arrivals
    ]


def _mixed_text(arrivals: Sequence[Arrival], a: Arrival, i: int, params: list[Tensor]) -> str:
    names = [_names(b.record) for b in arrivals]
    parts = ", ".join(
        f"rank {b.rank}'s {names[k].get(id(param), f'parameter of shape {list(param.shape)}')!r}"
        for k, (b, param) in enumerate(zip(arrivals, params, strict=True))
    )
    name = names[a.rank].get(id(a.params[i]), f"parameter {i}")
    skipping = any(
        getattr(w, "skip_all_reduce_unused_params", False)
        for b in arrivals
        for w in b.record.wrappers.values()
    )
    if skipping:
        why = (
            "The wrapper runs with skip_all_reduce_unused_params=True: each rank skips the "
            "buckets of the parameters it did not use, and the ranks used different ones, so "
            "their collectives paired different buckets of the same size. Use the same "
            "parameters on every rank, or leave skip_all_reduce_unused_params off."
        )
    else:
        why = (
            "The ranks' collectives paired different buckets of the same size: they reduced "
            "their gradients in different orders, or skipped different buckets. Every rank "
            "must reduce the same buckets in the same order."
        )
    return (
        f"The reduction summed different parameters across ranks: rank {a.rank}'s {name!r} is "
        f"bit for bit the average of {parts}. {why}"
    )


def _no_gradient(arrivals: Sequence[Arrival], i: int) -> str:
    """Parameters that got no gradient on some rank, of a wrapper that does not look for
    unused parameters: the reason a reduction never launched."""
    parts = []
    for a in arrivals:
        forwards, _ = _governing(a.record, a.params[i])
        wrapper = forwards[-1].wrapper if forwards else None
        if wrapper is None or getattr(wrapper, "find_unused_parameters", True):
            continue
        if getattr(wrapper, "static_graph", False):
            continue
        names = [
            name.removeprefix("module.")
            for name, p in wrapper.named_parameters()
            if p.requires_grad and id(p) not in a.record.local
        ]
        if names:
            shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
            parts.append(f"rank {a.rank}: {shown}")
    if not parts:
        return ""
    return (
        "Parameters got no gradient in this backward ("
        + "; ".join(parts)
        + ") and the wrapper does not look for unused parameters (find_unused_parameters=False)"
    )


def _reduced_too_early(record: RankRecord, param: Tensor) -> bool:
    """A synced forward of a wrapper holding ``param`` ran, then an unsynced one (the
    forwards first), then its reductions were issued (in a backward), and autograd
    accumulated into ``param`` after the last of them."""
    local = record.local.get(id(param))
    forwards = [f for f in record.forwards if _owned(f.wrapper, param)]
    synced = [f.clock for f in forwards if f.synced]
    reductions = [c.clock for c in record.collectives if c.kind in REDUCTIONS]
    if local is None or not synced or not reductions:
        return False
    last = reductions[-1]
    between = any(not f.synced and synced[-1] < f.clock < last for f in forwards)
    return between and synced[-1] < last < local[1]


def _unsynced_cause(forwards: list[Forward], record: RankRecord) -> str:
    if not forwards:
        return "the wrapper's forward did not run (called through `.module`?)"
    last = forwards[-1]
    kind = type(last.wrapper).__qualname__
    if last.why_not == "no_sync":
        return f"{kind}'s forward ran under no_sync() on the optimizer step's micro-batch"
    if last.why_not == "require_backward_grad_sync":
        return f"{kind}'s forward ran with require_backward_grad_sync=False on the last micro-step"
    if last.why_not == "no_grad":
        return f"{kind}'s forward ran with gradients disabled"
    return f"{kind}'s forward ran synced before this gradient's last accumulation"


def _wrapper_holding(param: Tensor) -> nn.Module | None:
    """The wrapper object that holds ``param``, found among live objects (only when a report
    needs it: a wrapper whose forward never ran left no other trace)."""
    types = wrapper_types()
    for obj in gc.get_objects():
        # type(), not isinstance: isinstance reads __class__, which some objects warn about.
        if issubclass(type(obj), types) and any(p is param for p in obj.parameters()):
            found: nn.Module = obj
            return found
    return None


def _comm_hook(wrapper: nn.Module) -> str | None:
    hooks = getattr(wrapper, "_comm_hooks", None)  # torch's DDP
    if hooks:
        return getattr(hooks[0][0], "__qualname__", repr(hooks[0][0]))
    inner = getattr(getattr(wrapper, "reducer", None), "_comm_hook", None)  # this project's
    if inner is not None:
        return getattr(inner[1], "__qualname__", repr(inner[1]))
    return None


def _average_case(
    arrivals: Sequence[Arrival], i: int
) -> tuple[int, list[Tensor], Tensor] | Finding | None:
    """(i, the ranks' local gradients, the reduced gradient) where a wrapper reduced parameter
    ``i`` on every rank and nothing changed it since; a note where something did; None where
    the arithmetic is not known (reduced by hand, a local gradient unknown)."""
    step = arrivals[0].step
    for a in arrivals:
        forwards, reduced = _governing(a.record, a.params[i])
        if not reduced or not any(f.synced for f in forwards):
            return None  # reduced by hand, or not by a wrapper: no known arithmetic
    locals_ = [a.record.local.get(id(a.params[i])) for a in arrivals]
    if any(loc is None or loc[0] is None for loc in locals_):
        return None
    for a in arrivals:
        grad = a.params[i].grad
        if a.record.unscaled:
            # GradScaler.unscale_ divides in place with a kernel that does not bump versions.
            text = (
                f"gradients were unscaled by a GradScaler on rank {a.rank} before the step: "
                "the exact average is not checked where they were"
            )
            return Finding("note", step, "changed after backward", text, "unscaled")
        if grad is None or a.record.settled.get(id(a.params[i])) != (id(grad), grad._version):
            # Changed after the backward (clipping, unscaling, a division by hand): the
            # reducer's result is gone, and the ranks agree, so nothing more to judge.
            text = (
                f"gradients were changed after the backward on rank {a.rank} (gradient "
                "clipping or unscaling?): the exact average is not checked where they were"
            )
            return Finding("note", step, "changed after backward", text, "changed")
    got = arrivals[0].params[i].grad
    assert got is not None
    grads = [loc[0] for loc in locals_ if loc is not None and loc[0] is not None]
    if any(g.is_sparse or g.shape != got.shape or g.dtype != got.dtype for g in grads):
        return None
    return (i, [host(g) for g in grads], host(got))


def _check_average(arrivals: Sequence[Arrival], i: int, name: str, where: str) -> Finding | None:
    """Where a wrapper reduced parameter ``i`` on every rank: is it the exact rank-order
    average of the ranks' local gradients? Skipped when a rank's local gradient is unknown."""
    case = _average_case(arrivals, i)
    if case is None or isinstance(case, Finding):
        return case
    _, grads, got = case
    world = len(arrivals)
    step = arrivals[0].step
    wrappers = [_governing(a.record, a.params[i])[0][-1].wrapper for a in arrivals]
    # See Note [The roundings of an exact average] (reducer/_averages.py).
    cause = explain(got, grads, world)
    if cause is None:
        return None
    hook = _comm_hook(wrappers[0])
    if hook is not None and cause.startswith("it differs"):
        diff = max_diff(average(grads, world, "reciprocal"), got)  # type: ignore[arg-type]
        text = (
            f"gradient of {name!r} {where} differs from the exact rank-order average by up to "
            f"{diff:.3g}: the comm hook {hook} changes it (expected for compressing hooks)."
        )
        return Finding("note", step, "comm hook changes the average", text, f"hook:{hook}")
    via = f" (comm hook {hook})" if hook is not None else ""
    text = (
        f"gradient of {name!r} {where} is identical on every rank but is not the exact "
        f"rank-order average of the ranks' local gradients (sum of g_r * (1/{world}), of "
        f"g_r / {world}, or the sum / {world}){via}: "
        f"{cause}."
    )
    return Finding("error", step, "wrong average", text, name)


def _waste(arrivals: Sequence[Arrival]) -> list[Finding]:
    """Synced forwards of a wrapper before more than one backward between two steps: each
    backward reduces everything."""
    out = []
    a = arrivals[0]
    by_wrapper: dict[int, list[Forward]] = {}
    for f in a.record.forwards:
        if f.synced:
            by_wrapper.setdefault(id(f.wrapper), []).append(f)
    for synced in by_wrapper.values():
        # Forwards before the same backward (a siamese step) arm one reduction between them:
        # a micro-step is a backward, however many forwards it took.
        micro_steps = len({f.backward for f in synced})
        if micro_steps < 2:
            continue
        kind = type(synced[0].wrapper).__qualname__
        count = sum(1 for c in a.record.collectives if c.kind in REDUCTIONS)
        if any(f.no_sync_after for f in synced):
            cause = (
                "no_sync() wrapped only the backward; the forward decides whether backward "
                "reduces, so the block did nothing: run the forward inside no_sync() too"
            )
            key = "no_sync-backward-only"
        else:
            cause = (
                "accumulate the other micro-steps under no_sync() or with "
                "require_backward_grad_sync=False"
            )
            key = "sync-every-micro-step"
        text = (
            f"{kind} reduced gradients on {micro_steps} micro-steps before optimizer step "
            f"{a.step} ({a.line}), {count} reductions where one micro-step's would do: {cause}."
        )
        out.append(Finding("warning", a.step, "redundant reductions", text, key))
    return out


# -------------------------------------------------------------------------------------------
# After the step.


def after_step(arrivals: Sequence[Arrival]) -> Audit:
    first = arrivals[0]
    step, line = first.step, first.line
    if any(len(a.params) != len(first.params) for a in arrivals):
        return Audit([], 0, 0)
    findings: list[Finding] = []
    replicas = [[_replica(p) for p in a.params] for a in arrivals]
    idx = [i for i in range(len(first.params)) if all(r[i] is not None for r in replicas)]
    agree = _agree([[r[i] for i in idx] for r in replicas])  # type: ignore[misc]
    names = {} if agree else _names(first.record)
    for i, param in enumerate(first.params):
        if agree:
            break  # See Note [All parameters at once].
        values = _present([_replica(a.params[i]) for a in arrivals])
        if values is None or any(v.shape != values[0].shape for v in values):
            continue
        differ = _differ(values)
        if differ:
            name = names.get(id(param), f"parameter {i} (shape {list(param.shape)})")
            text = (
                f"parameter {name!r} differs after optimizer step {step} ({line}): "
                f"{_ranks_text(differ, values)}.\n  The gradients agreed before the step: the "
                "optimizer's state or its settings differ per rank (a rank-dependent learning "
                "rate, a per-rank scheduler or clipping inside the step?)."
            )
            findings.append(Finding("error", step, "parameters differ", text, name))
            return Audit(findings, 0, 0)
    buffers = [_buffers(a.record, a.ignored) for a in arrivals]
    common = [
        name
        for name, buf in buffers[0].items()
        if all(
            (v := b.get(name)) is not None and v.shape == buf.shape and v.dtype == buf.dtype
            for b in buffers
        )
    ]
    if _agree([[b[name] for name in common] for b in buffers]):
        return Audit(findings, 0, 0)
    for name, buf in buffers[0].items():
        values = _present([b.get(name) for b in buffers])
        if values is None or any(v.shape != buf.shape or v.dtype != buf.dtype for v in values):
            continue
        differ = _differ(values)
        if differ:
            text = (
                f"buffer {name!r} differs after optimizer step {step}: "
                f"{_ranks_text(differ, values)} (legitimate with broadcast_buffers=False)."
            )
            findings.append(Finding("note", step, "buffers differ", text, f"buffer:{name}"))
    return Audit(findings, 0, 0)


# -------------------------------------------------------------------------------------------
# Tensors and names.


def _replica(t: Tensor) -> Tensor | None:
    """``t`` as compared across ranks: itself, a replicated DTensor's local tensor, or None
    for a shard (each rank holds a different piece: nothing to compare)."""
    if type(t) in (Tensor, nn.Parameter):
        return t.detach()
    placements = getattr(t, "placements", None)
    if placements is not None and all(p.is_replicate() for p in placements):
        return t.to_local().detach()  # type: ignore[attr-defined, no-any-return]
    return None


def _present(values: list[Tensor | None]) -> list[Tensor] | None:
    """``values`` if every rank has one, else None."""
    out = [v for v in values if v is not None]
    return out if len(out) == len(values) else None


def _replica_grad(t: Tensor) -> Tensor | None:
    grad = t.grad
    return None if grad is None else _replica(grad)


def _differ(values: Sequence[Tensor]) -> list[int]:
    """The ranks whose tensor is not bit-identical to rank 0's."""
    return [r for r, v in enumerate(values) if r and not bits_equal(values[0], v)]


def _ranks_text(differ: list[int], values: Sequence[Tensor]) -> str:
    diff = max(max_diff(values[0], values[r]) for r in differ)
    ranks = ", ".join(map(str, differ))
    verb = "rank {} disagrees" if len(differ) == 1 else "ranks {} disagree"
    return f"{verb.format(ranks)} with rank 0, by up to {diff:.6g}"


def _roots(record: RankRecord) -> list[nn.Module]:
    """The modules run on this rank that no other module run on it contains."""
    children = {id(c) for m in record.seen.values() for c in m.children()}
    return [m for k, m in record.seen.items() if k not in children]


def _prefix_free(module: nn.Module, name: str) -> str:
    if isinstance(module, wrapper_types()):
        return name.removeprefix("module.")
    return name


def _names(record: RankRecord) -> dict[int, str]:
    """id(param) -> its qualified name in the model (a wrapper's "module." left out)."""
    out: dict[int, str] = {}
    for root in _roots(record):
        for name, p in root.named_parameters():
            out.setdefault(id(p), _prefix_free(root, name))
    return out


def _buffers(record: RankRecord, ignored: frozenset[int] = frozenset()) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    for root in _roots(record):
        for name, b in root.named_buffers():
            # A DTensor buffer is a shard, an ignored one the rank's own: not compared.
            if type(b) is Tensor and id(b) not in ignored:
                out.setdefault(_prefix_free(root, name), b)
    return out
