"""Judging a played scenario: replay every rank's step with plain autograd, ask the
:class:`~reducer.testing.algorithms.Reference` what each rank must hold, and compare, step by
step, with what each rank held; on a mismatch, say what the value looks like instead.

The replay follows the run: where the reference accepts several values (the roundings of an
exact average), the plain model takes the one the rank held, so that the next step starts
from the same bits on both sides.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from reducer._averages import FORMULAS, ROUNDINGS, average, bits_equal, explain, max_diff

from ._run import SGD, OptimizerFactory, RankStreams, RankTrace, buffers_of, full, load_buffers
from .algorithms import Candidates, Reference, StepGradients
from .scenario import TrainingScenario

__all__ = ["CheckReport"]

Grads = list[Tensor | None]


@dataclass(frozen=True)
class CheckReport:
    """What a passing check saw. ``compared``: gradients compared (rank, step, parameter);
    ``matched``: how many of them each acceptable value matched (a rounding, "local", ...;
    at a power-of-two world size every rounding matches every gradient); ``roundings``: the
    roundings that every compared gradient equals (what ``scaling=`` would pass with).
    ``in_flight``: under a schedule, (how many of the collectives issued were left in flight
    across a later operation of their rank, how many were issued); see
    :func:`reducer.testing.schedule.in_flight`."""

    steps: int
    compared: int
    matched: dict[str, int] = field(default_factory=dict)
    exact: bool = True  # False: compared within the bounds a lossy hook was given
    in_flight: tuple[int, int] | None = None

    @property
    def roundings(self) -> tuple[str, ...]:
        if not self.exact or not self.compared:
            return ()
        return tuple(r for r in ROUNDINGS if self.matched.get(r, 0) == self.compared)

    def __str__(self) -> str:
        window = ""
        if self.in_flight is not None:
            left, issued = self.in_flight
            window = (
                f"; {left} of {issued} collectives left in flight across a later operation of "
                "their rank"
            )
        if not self.exact:
            return (
                f"{self.compared} gradients over {self.steps} steps within the stated bounds"
                + window
            )
        seen = ", ".join(f"{r} ({FORMULAS[r]})" for r in self.roundings) or "no single one"
        counts = ", ".join(f"{name}: {n}" for name, n in self.matched.items())
        return (
            f"{self.compared} gradients over {self.steps} steps exact; the roundings they all "
            f"equal: {seen}; matched by each: {counts}" + window
        )


@dataclass
class Bounds:
    """How closely a gradient must match: bit for bit where every bound is 0/None."""

    atol: float = 0.0
    rtol: float = 0.0
    cumulative_atol: float | None = None
    range_rtol: float | None = None
    norm_rtol: float | None = None

    @property
    def exact(self) -> bool:
        return (
            self.atol == 0.0
            and self.rtol == 0.0
            and self.range_rtol is None
            and self.norm_rtol is None
        )


def _same(a: Tensor, b: Tensor) -> bool:
    """Equal values (0.0 and -0.0 alike, as torch.equal) or equal bits (NaNs alike)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(torch.equal(a, b)) or bits_equal(a, b)


def judge(
    s: TrainingScenario,
    runs: Sequence[RankTrace],
    reference: Reference,
    *,
    optimizer: OptimizerFactory | None,
    broadcast_buffers: bool,
    check_strides: bool,
    bounds: Bounds,
    built: Sequence[torch.nn.Module] = (),
) -> CheckReport:
    """Replay ``s`` on plain models (``built``: some already built by ``make_model`` and
    untouched, used first) and compare every rank's trace with what ``reference`` says."""
    world = s.world_size
    plain = _Plain(s, reference.optimizer or optimizer, built)
    models, names, params, optims = plain.models, plain.names, plain.params, plain.optims
    ignored = frozenset(i for i, n in enumerate(names) if n in s.ignored)
    matched: Counter[str] = Counter()
    compared = 0
    sums: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}
    for step in range(s.steps):
        sg = plain.step_gradients(step, broadcast_buffers, ignored)
        trains = sg.trains
        expected = reference.gradients(sg)
        _validate(reference, expected, step, params, names, "gradient")
        found_at: list[list[list[str]]] = [[[] for _ in names] for _ in range(world)]
        for r in range(world):
            if not trains[r]:
                continue
            got = runs[r].grads[step]
            mine = _held_by(reference, expected[r], r, world)
            for i, name in enumerate(names):
                where = f"rank {r}, step {step}, parameter {i} ({name!r})" + _shard_of(
                    reference, r, world
                )
                found = _judge_one(got[i], mine[i], f"{where}, gradient", bounds, check_strides)
                if found is None:
                    raise AssertionError(
                        _mismatch(got[i], mine, r, i, sg, runs[r], f"{where}, gradient", reference)
                    )
                compared += got[i] is not None
                if bounds.exact and got[i] is not None:
                    matched.update(found)
                found_at[r][i] = found
            if not bounds.exact:
                _bucket_bounds(got, expected[r], runs[r], step, bounds, names, r)
            if bounds.cumulative_atol is not None:
                _running_sums(got, expected[r], sums, r, step, names, bounds.cumulative_atol)
        _adopt(reference, expected, found_at, trains, params, step, names)
        for r in range(world):
            if trains[r]:
                optims[r].step()
        stepped = [[p.detach().clone() for p in ps] for ps in params]
        after = reference.parameters(step, stepped, trains)
        if after is not None:
            _validate(reference, after, step, params, names, "parameter")
        for r in range(world):
            if not trains[r]:
                continue
            for i, name in enumerate(names):
                where = (
                    f"rank {r}, step {step}, parameter {i} ({name!r})"
                    + _shard_of(reference, r, world)
                    + ", after the step"
                )
                got_p = runs[r].params[step][i]
                cands: Candidates = (
                    {"plain": params[r][i].detach()} if after is None else after[r][i]
                )
                found = _judge_one(
                    got_p, _held_by(reference, [cands], r, world)[0], where, Bounds(), False
                )
                if not found:
                    want = reference.local(r, world, next(iter(cands.values())))  # type: ignore[arg-type]
                    mine_stepped = [[reference.local(r, world, p) for p in ps] for ps in stepped]
                    raise AssertionError(
                        f"{where}: not bitwise equal to the reference "
                        f"{type(reference).__name__.lstrip('_')}: differs by up to "
                        f"{max_diff(got_p, want):.3g}"
                        + _what_params_are(got_p, r, i, mine_stepped, trains)
                    )
                with torch.no_grad():
                    params[r][i].copy_(cands[found[0]])  # type: ignore[arg-type]
            _compare_buffers(runs[r].buffers[step], buffers_of(models[r]), r, step)
    _final(s, runs, params, plain.streams, reference)
    return CheckReport(s.steps, compared, dict(matched), bounds.exact)


def _adopt(
    reference: Reference,
    expected: Sequence[Sequence[Candidates]],
    found_at: Sequence[Sequence[list[str]]],
    trains: Sequence[bool],
    params: Sequence[Sequence[Tensor]],
    step: int,
    names: Sequence[str],
) -> None:
    """Give each plain model the gradient its rank matched, so that the next step starts
    from the same bits on both sides. With shards, one value for every rank: the first
    candidate every rank's shard matched (a rank's shard alone, an empty one above all, may
    match a rounding the whole gradient does not)."""
    ranks = [r for r in range(len(trains)) if trains[r]]
    for i, name in enumerate(names):
        chosen = {r: found_at[r][i] for r in ranks}
        if reference.sharded and ranks:
            common = [n for n in chosen[ranks[0]] if all(n in chosen[r] for r in ranks)]
            if any(chosen.values()) and not common:
                seen = "; ".join(f"rank {r}: {', '.join(chosen[r])}" for r in ranks)
                raise AssertionError(
                    f"step {step}, parameter {i} ({name!r}): each rank's shard of the gradient "
                    f"matches the reference, but no one value matches every shard ({seen}): "
                    "the shards were reduced with different roundings"
                )
            chosen = dict.fromkeys(ranks, common)
        for r in ranks:
            adopt = expected[r][i][chosen[r][0]] if chosen[r] else None
            params[r][i].grad = None if adopt is None else adopt.clone()


def _held_by(
    reference: Reference, expected: Sequence[Candidates], rank: int, world_size: int
) -> list[Candidates]:
    """The candidates as ``rank`` holds them (its shards, for a sharded reference)."""
    if not reference.sharded:
        return list(expected)
    return [
        {n: None if w is None else reference.local(rank, world_size, w) for n, w in c.items()}
        for c in expected
    ]


def _shard_of(reference: Reference, rank: int, world_size: int) -> str:
    return f", rank {rank}'s shard" if reference.sharded else ""


class _Plain:
    """The reference's side of a check: one plain model and optimizer per rank, stepped as
    the scenario says, whose local gradients the reference turns into what each rank must
    hold (each step's :class:`StepGradients`)."""

    def __init__(
        self,
        s: TrainingScenario,
        optimizer: OptimizerFactory | None,
        built: Sequence[torch.nn.Module] = (),
    ) -> None:
        self.s = s
        kept = list(built[: s.world_size])
        self.models = kept + [s.make_model() for _ in range(s.world_size - len(kept))]
        self.names = tuple(name for name, _ in self.models[0].named_parameters())
        self.params = [list(m.parameters()) for m in self.models]
        make_opt = optimizer or (lambda ps: SGD(ps, s.lr))
        self.optims = [make_opt(ps) for ps in self.params]
        self.streams = RankStreams(s.rank_seeds)
        # Was the last forward through the wrapper synced (DDP's require_forward_param_sync:
        # only then does the next forward sync the buffers)?
        self.forward_synced = [True]

    def step_gradients(
        self, step: int, broadcast_buffers: bool, ignored: frozenset[int]
    ) -> StepGradients:
        """Zero the training ranks' gradients as the scenario says, run each micro-batch's
        forward and backward, and return every rank's local gradients of the step."""
        s, world, names, params = self.s, self.s.world_size, self.names, self.params
        trains = tuple(s.trains(step, r) for r in range(world))
        for r in range(world):
            if trains[r]:
                self.optims[r].zero_grad(set_to_none=s.set_to_none)
        before: tuple[Grads, ...] = tuple(
            [full(p.grad) for p in params[r]] if trains[r] else _nones(len(names))
            for r in range(world)
        )
        micro = _local_gradients(
            s, step, self.models, params, self.streams, broadcast_buffers, self.forward_synced
        )
        views = bool(s.options.get("gradient_as_bucket_view", False))
        return StepGradients(
            step, world, names, micro, s.syncs(step), before, trains, ignored, views
        )


def _local_gradients(
    s: TrainingScenario,
    step: int,
    models: Sequence[torch.nn.Module],
    params: Sequence[Sequence[Tensor]],
    streams: RankStreams,
    broadcast_buffers: bool,
    forward_synced: list[bool],
) -> tuple[tuple[Grads, ...], ...]:
    """Per rank, each micro-batch's gradients alone, from plain autograd. Every rank's forward
    starts from rank 0's buffers (``broadcast_buffers``, DDP's default: synced by name before
    a forward through the wrapper whose previous one was synced, ``forward_synced[0]``, kept
    across steps; ignored ones excepted) or from its own. A "by_hand" micro-batch runs the
    inner module, not the wrapper: no buffers are synced before it, nor does it count."""
    world = s.world_size
    micro: list[list[Grads]] = [[] for _ in range(world)]
    kept = [[p.grad for p in ps] for ps in params]
    for m, mode in enumerate(s.syncs(step)):
        through_wrapper = mode != "by_hand"
        if broadcast_buffers and through_wrapper and forward_synced[0]:
            synced = {n: b for n, b in buffers_of(models[0]).items() if n not in s.ignored}
            for model in models[1:]:
                load_buffers(model, synced)
        for r in range(world):
            if not s.trains(step, r):
                continue
            batch = s.batch(step, r)
            for p in params[r]:
                p.grad = None
            with streams.of(r):
                batch.loss(models[r](*batch.micro_batches[m])).backward()  # type: ignore[no-untyped-call]
            micro[r].append([full(p.grad) for p in params[r]])
        if through_wrapper:
            forward_synced[0] = mode == "sync"
    for ps, grads in zip(params, kept, strict=True):
        for p, g in zip(ps, grads, strict=True):
            p.grad = g
    return tuple(tuple(m) for m in micro)


def _validate(
    reference: Reference,
    expected: Any,
    step: int,
    params: Sequence[Sequence[Tensor]],
    names: Sequence[str],
    what: str,
) -> None:
    """A reference's answer has one entry per rank and parameter, each a dict of tensors of
    the parameter's shape and dtype (or None for a gradient)."""
    kind = type(reference).__qualname__
    if not isinstance(expected, list | tuple) or len(expected) != len(params):
        raise ValueError(
            f"reference {kind}, step {step}: expected one list per rank ({len(params)}) of "
            f"{what}s, got {type(expected).__name__}"
        )
    for r, per_rank in enumerate(expected):
        if len(per_rank) != len(names):
            raise ValueError(
                f"reference {kind}, rank {r}, step {step}: {len(per_rank)} {what}s for a model "
                f"of {len(names)} parameters"
            )
        for i, cands in enumerate(per_rank):
            where = f"reference {kind}, rank {r}, step {step}, parameter {i} ({names[i]!r})"
            if not isinstance(cands, dict) or not cands:
                raise ValueError(
                    f"{where}: expected a dict of acceptable {what}s by name, got {cands!r}"
                )
            p = params[r][i]
            for label, t in cands.items():
                if t is None and what == "gradient":
                    continue
                if not isinstance(t, Tensor) or t.shape != p.shape or t.dtype != p.dtype:
                    got = (
                        f"shape {tuple(t.shape)} {t.dtype}"
                        if isinstance(t, Tensor)
                        else type(t).__name__
                    )
                    raise ValueError(
                        f"{where}: the {what} {label!r} must have the parameter's shape "
                        f"{tuple(p.shape)} and dtype {p.dtype}, got {got}"
                    )


def _judge_one(
    got: Tensor | None, cands: Candidates, where: str, bounds: Bounds, strides: bool
) -> list[str] | None:
    """The names of the candidates ``got`` matches ([] for no gradient where one is allowed
    to be missing); None where it matches none. Raises for a wrong layout, and, with bounds,
    for a value beyond them."""
    if got is None:
        return [n for n, w in cands.items() if w is None] or None
    present = {n: w for n, w in cands.items() if w is not None}
    if not present:
        raise AssertionError(
            f"{where}: expected no gradient (unused on every rank), got a gradient"
        )
    first = next(iter(present.values()))
    if got.shape != first.shape or got.dtype != first.dtype:
        raise AssertionError(
            f"{where}: expected {tuple(first.shape)} {first.dtype}, "
            f"got {tuple(got.shape)} {got.dtype}"
        )
    if strides and got.stride() != first.stride():
        raise AssertionError(
            f"{where}: strides {got.stride()} where plain autograd gives {first.stride()} "
            "(the wrapper must keep the gradient's memory layout)"
        )
    if bounds.exact:
        found = [n for n, w in present.items() if _same(w, got)]
        return found or None
    per_bucket = bounds.range_rtol is not None or bounds.norm_rtol is not None
    if bounds.rtol or (bounds.atol and not per_bucket):  # with per-bucket bounds, atol is theirs
        torch.testing.assert_close(
            got,
            first,
            atol=bounds.atol,
            rtol=bounds.rtol,
            msg=lambda m: f"{where}: beyond the stated bound: {m}{_overflow(got, first)}",
        )
    return [next(iter(present))]


def _overflow(got: Tensor, want: Tensor) -> str:
    """A diagnosis line where ``got`` is inf or NaN and the exact value is finite."""
    if not got.is_floating_point():
        return ""
    bad = ~torch.isfinite(got) & torch.isfinite(want)
    if not bool(bad.any()):
        return ""
    index = tuple(int(k) for k in torch.nonzero(bad)[0])
    return (
        f"\n  Diagnosis: {int(bad.sum())} element(s) are {got[index].item()} where the exact "
        f"average is finite (at {index}: {want[index].item()!r}): an overflow, a sum past the "
        "range of the dtype it was taken in (divide before summing, or sum in a wider dtype)."
    )


def _mismatch(
    got: Tensor | None,
    expected: Sequence[Candidates],
    r: int,
    i: int,
    s: StepGradients,
    run: RankTrace,
    where: str,
    reference: Reference,
) -> str:
    """The failure message: where, by how much, and what ``got`` looks like instead
    (``expected``: rank r's candidates per parameter, as it holds them)."""
    cands = expected[i]
    if got is None:
        return f"{where}: expected a gradient, got None"
    want = next(w for w in cands.values() if w is not None)
    differ = int((got != want).sum())
    diff = (got.double() - want.double()).abs()
    index = tuple(int(k) for k in torch.nonzero(diff == diff.max())[0]) if got.numel() else ()
    head = (
        f"{where}: not bitwise equal to the exact reference; {differ} of {got.numel()} "
        f"elements differ, the most at index {index}: {got[index].item()!r} vs "
        f"{want[index].item()!r} (abs difference {diff.max().item():.3g})"
    )
    accepted = tuple(n for n in cands if n in ROUNDINGS) or ROUNDINGS
    column = [
        _mine(reference, r, s.world_size, s.accumulated(q)[i]) if s.trains[q] else None
        for q in range(s.world_size)
    ]
    cause = explain(got, column, s.world_size, accepted=accepted)
    if cause is None or cause.startswith("it differs"):
        shifted = _shifted(got, expected, i, s.names)
        cause = shifted or cause
    if cause is not None and "local gradient: nothing was reduced" in cause:
        mine = set(run.param_storages[s.step]) - {0}
        if mine & run.reduced[s.step]:
            cause += (
                "; and this rank's reductions in this step wrote into the parameters' own "
                "storage: parameter values were averaged instead of gradients"
            )
    return head + (f".\n  Diagnosis: {cause}." if cause else "")


def _mine(reference: Reference, rank: int, world_size: int, t: Tensor | None) -> Tensor | None:
    return None if t is None else reference.local(rank, world_size, t)


def _shifted(
    got: Tensor, expected: Sequence[Candidates], i: int, names: Sequence[str]
) -> str | None:
    """Is ``got`` what another parameter of the same shape should have got?"""
    for j, cands in enumerate(expected):
        if j == i:
            continue
        if any(w is not None and _same(w, got) for w in cands.values()):
            return (
                f"it is the gradient parameter {j} ({names[j]!r}) should have: a bucket's "
                "gradients were written onto another parameter (a hook or a closure bound to "
                "the wrong bucket or offset)"
            )
    return None


def _what_params_are(
    got: Tensor, r: int, i: int, stepped: Sequence[Sequence[Tensor]], trains: Sequence[bool]
) -> str:
    """What a rank's parameter after the step is, where the reference expected another value:
    its own optimizer's result (not averaged), or the average over a group of consecutive
    ranks (a model averager's period or group)."""
    world = len(stepped)
    if _same(stepped[r][i], got):
        return ". It is this rank's own optimizer result: no model averaging ran in this step"
    sizes = [n for n in range(2, world + 1) if world % n == 0]
    for n in sizes:
        group = list(range(r - r % n, r - r % n + n))
        column = [stepped[q][i] for q in group]
        for rounding in ROUNDINGS:
            if _same(average(column, n, rounding), got):  # type: ignore[arg-type]
                return f". It is the average of ranks {group}' parameters after their step"
    return ""


def _bucket_bounds(
    got: Grads,
    expected: Sequence[Candidates],
    run: RankTrace,
    step: int,
    bounds: Bounds,
    names: Sequence[str],
    r: int,
) -> None:
    """The error of each bucket the comm hook was handed, against its exact values' range
    (``range_rtol``: max |error| <= range_rtol * (max - min)) or norm (``norm_rtol``:
    ||error|| <= norm_rtol * ||exact||), as a quantizer's or a low-rank hook's error scales."""
    if bounds.range_rtol is None and bounds.norm_rtol is None:
        return
    buckets = run.buckets[step] if step < len(run.buckets) else []
    buckets = buckets or [[i] for i in range(len(names))]
    for b, indices in enumerate(buckets):
        pairs: list[tuple[Tensor, Tensor]] = []
        for i in indices:
            g_i, w_i = got[i], next(iter(expected[i].values()))
            if g_i is not None and w_i is not None:
                pairs.append((g_i, w_i))
        if not pairs:
            continue
        g = torch.cat([p[0].double().reshape(-1) for p in pairs])
        w = torch.cat([p[1].double().reshape(-1) for p in pairs])
        error = (g - w).abs()
        where = (
            f"rank {r}, step {step}, bucket {b} (parameters "
            f"{', '.join(repr(names[i]) for i in indices)})"
        )
        if bounds.range_rtol is not None:
            limit = bounds.range_rtol * float(w.max() - w.min()) + bounds.atol
            if not float(error.max()) <= limit:
                raise AssertionError(
                    f"{where}: error up to {float(error.max()):.3g}, beyond range_rtol x the "
                    f"bucket's range ({bounds.range_rtol} x {float(w.max() - w.min()):.3g})"
                    + _overflow(g, w)
                )
        if bounds.norm_rtol is not None:
            limit = bounds.norm_rtol * float(w.norm()) + bounds.atol
            if not float(error.norm()) <= limit:
                raise AssertionError(
                    f"{where}: error of norm {float(error.norm()):.3g}, beyond norm_rtol x the "
                    f"bucket's norm ({bounds.norm_rtol} x {float(w.norm()):.3g})" + _overflow(g, w)
                )


def _running_sums(
    got: Grads,
    expected: Sequence[Candidates],
    sums: dict[tuple[int, int], tuple[Tensor, Tensor]],
    r: int,
    step: int,
    names: Sequence[str],
    atol: float,
) -> None:
    """The running sums over steps of what the hook applied and of the exact gradients stay
    within ``atol``: the bound that error feedback keeps, and a hook that drops its residual
    breaks."""
    for i, name in enumerate(names):
        g, w = got[i], next(iter(expected[i].values()))
        if g is None or w is None:
            continue
        old = sums.get((r, i))
        new = (
            (g.double(), w.double()) if old is None else (old[0] + g.double(), old[1] + w.double())
        )
        sums[(r, i)] = new
        where = (
            f"rank {r}, step {step}, parameter {i} ({name!r}), running sum over steps "
            f"0..{step} (error feedback)"
        )
        torch.testing.assert_close(
            new[0],
            new[1],
            atol=atol,
            rtol=0.0,
            msg=_prefixed(where),
        )


def _prefixed(where: str) -> Callable[[str], str]:
    def message(m: str) -> str:
        return f"{where}: beyond the stated bound: {m}"

    return message


def _nones(n: int) -> Grads:
    return [None] * n


def _compare_buffers(got: dict[str, Tensor], want: dict[str, Tensor], r: int, step: int) -> None:
    if set(got) != set(want):
        raise AssertionError(
            f"rank {r}, step {step}: buffers {sorted(got)}, expected {sorted(want)}"
        )
    for name, value in want.items():
        if not _same(got[name], value):
            raise AssertionError(
                f"rank {r}, step {step}, buffer {name!r}: not bitwise equal to the reference "
                f"(differs by up to {max_diff(got[name], value):.3g})"
            )


def _final(
    s: TrainingScenario,
    runs: Sequence[RankTrace],
    params: Sequence[Sequence[Tensor]],
    streams: RankStreams,
    reference: Reference,
) -> None:
    """Each rank's random stream is its own; under join, every rank ends with the parameters
    of the highest rank of those that trained longest (join's final sync takes its model)."""
    states = streams.states()
    for rank, run in enumerate(runs):
        # A stream shared with another rank ends elsewhere, whatever order the draws took
        # (each step has a collective, so the other rank has seeded before this one ends).
        if s.rank_seeds is not None and not torch.equal(run.rng[0], states[rank]):
            raise AssertionError(
                f"rank {rank}: its random stream is not its own: after training, its generator "
                "is not where its own draws from its own seed leave it"
            )
        steps_run = sum(s.trains(k, rank) for k in range(s.steps))
        if len(run.grads) != steps_run:
            raise AssertionError(f"rank {rank}: ran {len(run.grads)} steps, expected {steps_run}")
    if not s.uneven:
        return
    last = max(range(s.world_size), key=lambda r: (sum(s.trains(k, r) for k in range(s.steps)), r))
    for rank, run in enumerate(runs):
        for i, name in enumerate(run.names):
            want = reference.local(rank, s.world_size, params[last][i].detach())
            if not _same(run.final[i], want):
                raise AssertionError(
                    f"rank {rank}, parameter {i} ({name!r}), after join (the last joiner's): "
                    f"not bitwise equal to the reference (differs by up to "
                    f"{max_diff(run.final[i], want):.3g})"
                )


def reference_alone(s: TrainingScenario, reference: Reference) -> list[list[Grads]]:
    """The reference's gradients per step and rank, with no run to follow (each value its
    first acceptable one): what the judge costs without a world (a benchmark's anchor)."""
    world = s.world_size
    plain = _Plain(s, reference.optimizer)
    out: list[list[Grads]] = []
    for step in range(s.steps):
        sg = plain.step_gradients(step, True, frozenset())
        expected = reference.gradients(sg)
        out.append([[next(iter(c.values())) for c in per_rank] for per_rank in expected])
        for r in range(world):
            for i, cands in enumerate(expected[r]):
                first = next(iter(cands.values()))
                plain.params[r][i].grad = None if first is None else first.clone()
            if sg.trains[r]:
                plain.optims[r].step()
    return out
