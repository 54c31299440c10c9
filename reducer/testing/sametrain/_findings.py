"""The verdict: does a W-rank run train the same model as one process on the global batch?

Judged from the evidence of :mod:`._evidence`. Each finding names the cause it can prove, the
evidence (ranks, steps, batches) and the fix in one line; what the evidence cannot decide is
said as a note, never claimed. See Note [The loss scale as one process would see it].
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from ._evidence import BackwardEv, ForwardEv, LoaderEv, RankEvidence

__all__ = ["CAUSES", "Finding", "Verdict", "judge"]

# The causes a finding names; each can be declared deliberate (see deliberate()).
CAUSES = {
    "same-batches": "every rank reads the same batches",
    "overlapping-shards": "ranks' shards overlap",
    "repeated-shuffle": "the shuffle repeats every epoch",
    "summed-loss": "the loss is a sum over the local batch",
    "accumulation-scale": "the loss is not divided by the accumulation steps exactly once",
    "loss-scale": "the step is a multiple of one process's",
    "replay-mismatch": "the averaged gradient is not one process's on the global batch",
    "uneven-batches": "uneven local batches averaged as if equal",
    "per-rank-batchnorm": "BatchNorm statistics per rank",
    "same-seed": "every rank draws the same random numbers (dropout, augmentation)",
    "sampler-world": "a DistributedSampler built for another world",
}
_TOLERANCE = 1e-3  # relative: loss values are float32 scalars, ratios of them round


@dataclass(frozen=True, slots=True)
class Finding:
    """One proven way the run differs from one process on the global batch."""

    cause: str  # a key of CAUSES
    text: str  # what and why, one sentence
    evidence: str  # ranks, steps, batches
    fix: str  # one line


@dataclass(slots=True)
class Verdict:
    """The findings (after the declared deliberate choices), the notes, and the counts."""

    world_size: int
    steps: int
    forwards: int
    findings: list[Finding] = field(default_factory=list)
    silenced: list[Finding] = field(default_factory=list)  # declared deliberate
    notes: list[str] = field(default_factory=list)  # what was checked, what could not be
    seen: list[str] = field(default_factory=list)  # what the evidence holds, one line each

    @property
    def same(self) -> bool:
        return not self.findings and self.forwards > 0

    def headline(self) -> str:
        if self.forwards == 0:
            return "verdict: no training forward of a data-parallel wrapper ran: nothing judged"
        if self.findings:
            n = len(self.findings)
            return (
                f"verdict: NOT the same training as one process on the global batch "
                f"({n} finding{'s' if n != 1 else ''})"
            )
        return "verdict: the same training as one process on the global batch"

    def report(self) -> str:
        """The report as printed: the question, each finding, the notes, the verdict."""
        w = self.world_size
        lines = [
            f"does this {w}-rank run train the same model as one process on the global batch?",
            f"evidence: {self.steps} optimizer step(s), {self.forwards} training forward(s) "
            "per rank",
        ]
        lines += [f"  {line}" for line in self.seen]
        for finding in self.findings:
            lines += [
                f"FINDING ({finding.cause}): {finding.text}",
                f"  evidence: {finding.evidence}",
                f"  fix: {finding.fix}",
            ]
        if self.silenced:
            causes = sorted({f.cause for f in self.silenced})
            lines.append(f"declared deliberate, not reported: {', '.join(causes)}")
        lines += [f"note: {note}" for note in self.notes]
        lines.append(self.headline())
        return "\n".join(lines)


def judge(
    ranks: Sequence[RankEvidence], deliberate: frozenset[str] = frozenset(), *, seeds: bool = True
) -> Verdict:
    """The verdict on the evidence of every rank. ``seeds``: the ranks seeded their own
    generators (a launch); False where one process ran them in turn (a step under test), so
    their generator states say nothing."""
    world = len(ranks)
    forwards = min((len(r.forwards) for r in ranks), default=0)
    verdict = Verdict(world, min((r.steps for r in ranks), default=0), forwards)
    if world < 2 or forwards == 0:
        if world < 2:
            verdict.notes.append("one rank: nothing to compare")
        return verdict
    verdict.seen += _seen(ranks)
    found: list[Finding] = []
    same_batches = _same_batches(ranks, found, seeds)
    if not same_batches:
        _overlap(ranks, found, verdict.notes)
    _repeated_shuffle(ranks, found)
    _sampler_world(ranks, found, same_batches)
    _loss_scale(ranks, found, verdict.notes)
    _batchnorm(ranks, found)
    if seeds:
        _same_seed(ranks, found)
    for finding in found:
        (verdict.silenced if finding.cause in deliberate else verdict.findings).append(finding)
    return verdict


# -------------------------------------------------------------------------------------------
# Data.


def _seen(ranks: Sequence[RankEvidence]) -> list[str]:
    """What the evidence holds: the training loaders and the loss functions (rank 0's)."""
    lines = []
    for loaders in _training_loaders(ranks):
        first = loaders[0]
        epochs = len(first.epochs)
        if first.num_replicas is None:
            lines.append(
                f"data: DataLoader #{first.order} with a {first.sampler}, {epochs} epoch(s)"
            )
            continue
        calls = len(ranks[0].samplers.get(first.sampler_id, []))
        lines.append(
            f"data: DataLoader #{first.order} with a DistributedSampler (num_replicas="
            f"{first.num_replicas}, shuffle={first.shuffle}), {epochs} epoch(s), set_epoch "
            f"called {calls} time(s) on rank 0"
        )
    if not lines:
        lines.append("data: no DataLoader fed the model: its inputs' fingerprints are compared")
    losses = sorted(
        {f"{loss.name} ({loss.reduction})" for b in ranks[0].backwards for loss in b.losses}
    )
    backwards = len(ranks[0].backwards)
    lines.append(
        f"loss: {', '.join(losses) if losses else 'no torch loss function seen'}, "
        f"{backwards} backward(s) on rank 0"
    )
    return lines


def _by_key(ranks: Sequence[RankEvidence]) -> dict[tuple[int, int], list[ForwardEv]]:
    """The training forwards every rank ran, keyed by (optimizer step, micro-step)."""
    keyed: dict[tuple[int, int], list[ForwardEv]] = defaultdict(list)
    for record in ranks:
        for forward in record.forwards:
            keyed[(forward.step, forward.micro)].append(forward)
    return {k: v for k, v in sorted(keyed.items()) if len(v) == len(ranks)}


def _groups(values: Sequence[str | None]) -> list[list[int]]:
    """Ranks grouped by equal value (None: unknown, in no group), only the groups of two or
    more."""
    groups: dict[str, list[int]] = defaultdict(list)
    for rank, value in enumerate(values):
        if value is not None:
            groups[value].append(rank)
    return [g for g in groups.values() if len(g) > 1]


def _training_loaders(ranks: Sequence[RankEvidence]) -> list[list[LoaderEv]]:
    """Per loader order, each rank's loader, for the loaders whose batches were trained on
    by every rank."""
    out = []
    orders = {o for r in ranks for o in (ld.order for ld in r.loaders.values() if ld.trained)}
    for order in sorted(orders):
        per_rank = [
            next((ld for ld in r.loaders.values() if ld.order == order), None) for r in ranks
        ]
        if all(ld is not None and ld.trained for ld in per_rank):
            out.append([ld for ld in per_rank if ld is not None])
    return out


def _steps_text(keys: Sequence[tuple[int, int]]) -> str:
    shown = ", ".join(f"{s}" if m == 0 else f"{s}.{m}" for s, m in keys[:6])
    return shown + (f" and {len(keys) - 6} more" if len(keys) > 6 else "")


def _same_batches(ranks: Sequence[RankEvidence], found: list[Finding], seeds: bool) -> bool:
    keyed = _by_key(ranks)
    matched: dict[tuple[int, ...], list[tuple[int, int]]] = defaultdict(list)
    for key, forwards in keyed.items():
        for group in _groups([f.fingerprint for f in forwards]):
            matched[tuple(group)].append(key)
    if not matched:
        return False
    best, keys = max(matched.items(), key=lambda item: len(item[1]))
    group = list(best)
    who = "every rank" if len(group) == len(ranks) else f"ranks {list(group)}"
    evidence = (
        f"ranks {list(group)} fed the model identical inputs (equal fingerprints) at "
        f"{len(keys)} of {len(keyed)} forward(s): step(s) {_steps_text(keys)}"
    )
    cause, fix = _batches_cause(ranks, group, keys, seeds)
    found.append(
        Finding("same-batches", f"{who} trained on the same batches: {cause}", evidence, fix)
    )
    return True


def _batches_cause(
    ranks: Sequence[RankEvidence],
    group: Sequence[int],
    keys: Sequence[tuple[int, int]],
    seeds: bool,
) -> tuple[str, str]:
    for loaders in _training_loaders(ranks):
        mine = [loaders[r] for r in group]
        first = mine[0]
        if first.num_replicas is None:
            return (
                f"their DataLoader's sampler is a {first.sampler}, not a DistributedSampler, "
                "so each rank reads the whole dataset in the same order",
                "DataLoader(dataset, sampler=DistributedSampler(dataset), ...) and "
                "sampler.set_epoch(epoch) before each epoch",
            )
        if first.num_replicas != len(ranks) or len({ld.rank for ld in mine}) == 1:
            built = ", ".join(
                f"rank {r}: num_replicas={loaders[r].num_replicas}, rank={loaders[r].rank}"
                for r in group
            )
            return (
                f"their DistributedSampler was built for another world ({built})",
                "DistributedSampler(dataset, num_replicas=world_size, rank=rank) (or neither, "
                "after init_process_group)",
            )
    forwards = _by_key(ranks)
    if not seeds:
        return (
            "the batches given for these ranks are equal",
            "give each rank its own shard of the global batch",
        )
    if all(len({forwards[k][r].rng for r in group}) == 1 for k in keys):
        return (
            "torch's generator had the same state on these ranks at every such forward (one "
            "seed for every rank), and the batches are drawn with it",
            "draw each rank's batches from a generator seeded with seed + rank (seed the "
            "model alike: DDP broadcasts rank 0's weights anyway)",
        )
    return (
        "where the batches come from was not seen (no DataLoader, generator states differ)",
        "give each rank its own shard of the data (DistributedSampler, or indices[rank::W])",
    )


def _overlap(ranks: Sequence[RankEvidence], found: list[Finding], notes: list[str]) -> None:
    for loaders in _training_loaders(ranks):
        epochs = min(len(ld.epochs) for ld in loaders)
        for epoch in range(epochs):
            seen = [
                {i for batch in ld.epochs[epoch] if batch is not None for i in batch}
                for ld in loaders
            ]
            shared: dict[tuple[int, int], set[int]] = {}
            for a in range(len(ranks)):
                for b in range(a + 1, len(ranks)):
                    common = seen[a] & seen[b]
                    if common:
                        shared[(a, b)] = common
            if not shared:
                continue
            total = len(set().union(*shared.values()))
            first = loaders[0]
            if (
                first.num_replicas == len(ranks)
                and first.drop_last is False
                and first.dataset_len is not None
            ):
                pad = -first.dataset_len % len(ranks)
                if total <= pad:
                    (a, b), common = next(iter(shared.items()))
                    found.append(
                        Finding(
                            "overlapping-shards",
                            f"samples are read twice every epoch: the DistributedSampler pads "
                            f"{first.dataset_len} samples to {first.dataset_len + pad}, a "
                            f"multiple of the {len(ranks)} ranks (drop_last=False), with "
                            "samples it already gave another rank",
                            f"epoch {epoch} of DataLoader #{first.order}: ranks {a} and {b} "
                            f"both read dataset indices {sorted(common)[:5]}; {total} sample(s) "
                            "read twice in all",
                            "DistributedSampler(dataset, drop_last=True), or a dataset size "
                            "divisible by world_size",
                        )
                    )
                    return
            (a, b), common = next(iter(shared.items()))
            sample = sorted(common)[:5]
            evidence = (
                f"epoch {epoch} of DataLoader #{first.order}: ranks {a} and {b} both read "
                f"{len(common)} sample(s) (dataset indices {sample}"
                f"{' ...' if len(common) > 5 else ''}); {total} sample(s) shared in all"
            )
            if first.num_replicas is None:
                cause = (
                    f"the ranks' samplers ({first.sampler}) are not a DistributedSampler and "
                    "their shards are not disjoint"
                )
            else:
                cause = "the ranks' DistributedSamplers do not split the dataset disjointly"
            found.append(
                Finding(
                    "overlapping-shards",
                    f"ranks train on overlapping shards: {cause}",
                    evidence,
                    "DistributedSampler(dataset) for disjoint shards (or a split such as "
                    "indices[rank::world_size])",
                )
            )
            return


def _repeated_shuffle(ranks: Sequence[RankEvidence], found: list[Finding]) -> None:
    for loaders in _training_loaders(ranks):
        for rank, loader in enumerate(loaders):
            if not loader.shuffle:
                continue
            complete = [e for e in loader.epochs if e and all(b is not None for b in e)]
            for later in range(1, len(complete)):
                if complete[later] == complete[0] and len(complete[0]) > 1:
                    calls = ranks[rank].samplers.get(loader.sampler_id, [])
                    cause = (
                        "sampler.set_epoch(epoch) is never called"
                        if not calls
                        else "sampler.set_epoch was called with the same epoch "
                        f"({sorted(set(calls))})"
                    )
                    found.append(
                        Finding(
                            "repeated-shuffle",
                            f"the shuffle repeats every epoch: {cause}, and a "
                            "DistributedSampler shuffles by its epoch",
                            f"rank {rank}, DataLoader #{loader.order}: epochs 0 and {later} "
                            f"read the same {len(complete[0])} batches in the same order "
                            f"(first: {list(complete[0][0] or ())[:5]})",
                            "call loader.sampler.set_epoch(epoch) at the start of each epoch",
                        )
                    )
                    return


def _sampler_world(ranks: Sequence[RankEvidence], found: list[Finding], named: bool) -> None:
    if named or any(f.cause == "overlapping-shards" for f in found):
        return  # already the named cause
    for loaders in _training_loaders(ranks):
        if loaders[0].num_replicas is None:
            continue
        sampler_ranks = sorted(ld.rank for ld in loaders if ld.rank is not None)
        if {ld.num_replicas for ld in loaders} != {len(ranks)} or sampler_ranks != list(
            range(len(ranks))
        ):
            built = "; ".join(
                f"rank {r}: num_replicas={ld.num_replicas}, rank={ld.rank}"
                for r, ld in enumerate(loaders)
            )
            found.append(
                Finding(
                    "sampler-world",
                    f"the DistributedSampler was built for another world than the "
                    f"{len(ranks)} ranks: some samples are never read, or read by two ranks",
                    built,
                    "DistributedSampler(dataset, num_replicas=world_size, rank=rank) (or "
                    "neither, after init_process_group)",
                )
            )
            return


# -------------------------------------------------------------------------------------------
# Note [The loss scale as one process would see it]
# DDP's gradient is (1/W) * sum over ranks r and micro-steps a of d(L_ra)/dtheta, where each
# backpropagated loss L_ra = s_ra * c_ra * sum_i l_i: the user's reduction c_ra (1/n_ra for a
# mean over n_ra elements, 1 for a sum) of per-element losses l_i, times a scale s_ra applied
# after it (loss / accumulation_steps; the ratio of the backpropagated value to the loss
# function's value, both recorded). One process on the global batch of the step (every rank's
# and micro-step's samples, N elements in all) computes c * sum_i l_i with c = 1/N (a mean) or 1
# (a sum). The per-element gradients are the same in both, so the two steps are equal exactly
# when every micro-batch's weight q_ra = s_ra * c_ra / (W * c) is 1. A q equal for every
# micro-batch but not 1 makes every step q times one process's; q unequal across ranks comes
# from unequal element counts averaged as equal. This reasons from recorded values and counts,
# not a replay: where a micro-step's loss is not one call of a torch loss function, or its
# value is 0, it claims nothing (a note says so). reducer.testing.check_same_training replays
# the step as one process and compares the gradients themselves.


def _loss_scale(ranks: Sequence[RankEvidence], found: list[Finding], notes: list[str]) -> None:
    world = len(ranks)
    steps = sorted({b.step for r in ranks for b in r.backwards})
    unclear = 0
    judged = 0
    partial = 0
    # The usual number of micro-steps per step: a step with fewer (an epoch's last, when the
    # batches do not divide by the accumulation steps) is left out of the accumulation causes.
    sizes = [max(sum(1 for b in r.backwards if b.step == step) for r in ranks) for step in steps]
    usual = max(set(sizes), key=sizes.count) if sizes else 0
    claims: dict[str, tuple[str, str, str]] = {}
    last = [max((b.step for b in r.backwards), default=-1) for r in ranks]
    for step in steps:
        units = [[b for b in r.backwards if b.step == step] for r in ranks]
        if any(not u for u in units):
            _ran_out(step, units, last, claims)
            continue
        flat = [(rank, b) for rank, u in enumerate(units) for b in u]
        terms = [_term(b) for _, b in flat]
        if any(t is None for t in terms):
            unclear += 1
            continue
        judged += 1
        known = [t for t in terms if t is not None]
        total = sum(n for _, n, _ in known)
        reductions = {red for red, _, _ in known}
        q_mean = [s * (1 / n if red == "mean" else 1.0) * total / world for red, n, s in known]
        q_sum = [s * (1 / n if red == "mean" else 1.0) / world for red, n, s in known]
        if _all_near(q_mean, 1.0) or _all_near(q_sum, 1.0):
            continue
        accum = max(len(u) for u in units)
        if accum != usual:
            partial += 1
            continue
        where = _loss_text(step, flat)
        if _all_near(q_mean, q_mean[0]) and _all_near(q_sum, q_sum[0]):
            q = q_sum[0] if reductions == {"sum"} else q_mean[0]
            if reductions == {"sum"}:
                claims.setdefault(
                    "summed-loss",
                    (
                        f"the loss is a sum over each rank's batch: DDP averages the ranks' "
                        f"gradients, so each step is {_factor(q)} one process's summing over the "
                        f"global batch ({_factor(q_mean[0])} one process's taking the mean)",
                        where,
                        "a mean over the local batch (reduction='mean'), or multiply the loss by "
                        "world_size to keep the sum",
                    ),
                )
            elif reductions == {"mean"} and accum > 1 and _near(q, accum):
                claims.setdefault(
                    "accumulation-scale",
                    (
                        f"loss / accumulation_steps is forgotten: {accum} micro-steps' mean "
                        f"losses are added, so each step is {_factor(q)} one process's",
                        where,
                        f"divide each micro-step's loss by the {accum} accumulation steps, once",
                    ),
                )
            elif reductions == {"mean"} and accum > 1 and _near(q, 1 / accum):
                claims.setdefault(
                    "accumulation-scale",
                    (
                        f"loss / accumulation_steps is applied twice: each step is "
                        f"{_factor(q)} one process's",
                        where,
                        "divide each micro-step's loss by the accumulation steps once",
                    ),
                )
            elif _simple(q):
                claims.setdefault(
                    "loss-scale",
                    (
                        f"each step is {_factor(q)} one process's on the global batch (the "
                        "backpropagated loss is scaled after its reduction)",
                        where,
                        "backpropagate the mean over the local batch divided by the "
                        "accumulation steps",
                    ),
                )
            else:
                unclear += 1
            continue
        counts = [n for _, n, _ in known]
        if len(set(counts)) > 1 and "uneven-batches" not in claims:
            per_rank = ", ".join(
                f"rank {rank}: {n} element(s), weight {q:.3g}"
                for (rank, _), (_, n, _), q in zip(flat, known, q_mean, strict=True)
            )
            claims["uneven-batches"] = (
                "uneven local batches are averaged as if equal: DDP gives each rank's mean "
                "the same weight, one process weighs every sample alike",
                f"step {step}: {per_rank} (1 is one process's)",
                "drop_last=True (equal batches), or scale each rank's loss by "
                "local_count * world_size / global_count",
            )
        elif len(set(counts)) == 1:
            unclear += 1
    for cause, (text, evidence, fix) in claims.items():
        found.append(Finding(cause, text, evidence, fix))
    if unclear and not claims:
        notes.append(
            f"loss scale: not judged at {unclear} step(s): the backpropagated loss is not one "
            "call of a torch loss function (or its scale is not a plain ratio); "
            "reducer.testing.check_same_training replays such a step"
        )
    if partial:
        notes.append(
            f"loss scale: {partial} step(s) with fewer micro-steps than the usual {usual} (an "
            "epoch's last) not judged"
        )
    if judged == 0 and steps and not unclear and not partial:
        notes.append("loss scale: not judged: no step had a loss every rank backpropagated")


def _ran_out(
    step: int,
    units: Sequence[Sequence[BackwardEv]],
    last: Sequence[int],
    claims: dict[str, tuple[str, str, str]],
) -> None:
    """A step only some ranks took, the others having backpropagated their last before it:
    uneven inputs under a wrapper's join(), whose ranks that ran out add zeros to the average
    (without join() the ranks would not meet; the replica check says so)."""
    present = [r for r, u in enumerate(units) if u]
    gone = [r for r, u in enumerate(units) if not u]
    if not present or any(last[r] >= step for r in gone) or "uneven-batches" in claims:
        return
    world = len(units)
    claims["uneven-batches"] = (
        f"uneven inputs: ranks {gone} ran out of batches and only ranks {present} took step "
        f"{step}; DDP's join() averages their gradients with zeros over all {world} ranks, so "
        f"the step is {len(present)}/{world} of one process's on those batches",
        f"step {step}: backpropagated on ranks {present} only; ranks {gone} had backpropagated "
        f"their last at step(s) {sorted({last[r] for r in gone})}",
        "give every rank as many batches (DistributedSampler pads, or drop_last=True), or "
        "join(divide_by_initial_world_size=False)",
    )


def _term(backward: BackwardEv) -> tuple[str, int, float] | None:
    """(reduction, elements, scale after the reduction) of a micro-step's loss, if known."""
    losses = [loss for loss in backward.losses if loss.reduction in ("mean", "sum")]
    if len(losses) != 1 or len(backward.losses) != 1:
        return None
    loss = losses[0]
    if loss.count <= 0 or loss.value == 0 or not math.isfinite(loss.value * backward.value):
        return None
    return loss.reduction, loss.count, backward.value / loss.value


def _loss_text(step: int, flat: Sequence[tuple[int, BackwardEv]]) -> str:
    parts = []
    for rank, backward in flat[:4]:
        loss = backward.losses[0]
        scale = backward.value / loss.value
        scaled = "" if _near(scale, 1.0) else f", backpropagated x {scale:.4g}"
        parts.append(
            f"rank {rank} micro-step {backward.micro}: {loss.name}(reduction='{loss.reduction}') "
            f"over {loss.count} element(s){scaled}"
        )
    more = f"; {len(flat) - 4} more" if len(flat) > 4 else ""
    return f"step {step}: " + "; ".join(parts) + more


def _near(a: float, b: float) -> bool:
    return abs(a - b) <= _TOLERANCE * max(abs(a), abs(b))


def _all_near(values: Sequence[float], target: float) -> bool:
    return all(_near(v, target) for v in values)


def _simple(q: float) -> bool:
    """A ratio a plain factor explains: an integer or its inverse."""
    x = q if q >= 1 else 1 / q
    return _near(x, round(x))


def _factor(q: float) -> str:
    if q >= 1:
        return f"{round(q)}x" if _near(q, round(q)) else f"{q:.3g}x"
    inverse = 1 / q
    return f"1/{round(inverse)} of" if _near(inverse, round(inverse)) else f"{q:.3g}x"


# -------------------------------------------------------------------------------------------
# Modules and random numbers.


def _batchnorm(ranks: Sequence[RankEvidence], found: list[Finding]) -> None:
    for record in ranks:
        for forward in record.forwards:
            if forward.batchnorm:
                names = ", ".join(forward.batchnorm[:4])
                more = (
                    f" and {len(forward.batchnorm) - 4} more" if len(forward.batchnorm) > 4 else ""
                )
                found.append(
                    Finding(
                        "per-rank-batchnorm",
                        "BatchNorm normalises with each rank's batch statistics, one process "
                        "with the global batch's (and the running statistics differ per rank)",
                        f"rank {record.rank}, step {forward.step}: the wrapped model trains "
                        f"BatchNorm without SyncBatchNorm: {names}{more}",
                        "model = nn.SyncBatchNorm.convert_sync_batchnorm(model) before DDP(...)",
                    )
                )
                return


def _same_seed(ranks: Sequence[RankEvidence], found: list[Finding]) -> None:
    keyed = _by_key(ranks)
    for key, forwards in keyed.items():
        if not any(f.dropout for f in forwards):
            continue
        for group in _groups([f.rng for f in forwards]):
            names = ", ".join(forwards[group[0]].dropout[:3])
            found.append(
                Finding(
                    "same-seed",
                    "every rank draws the same dropout masks: torch's generator is seeded alike",
                    f"ranks {group} had identical generator states at the forward of step "
                    f"{_steps_text([key])}, and the model has active dropout ({names})",
                    "seed each rank differently after building the model: "
                    "torch.manual_seed(seed + rank) (DDP broadcasts rank 0's weights)",
                )
            )
            return
    fetched: dict[tuple[int, int, int], list[tuple[int, str, bool]]] = defaultdict(list)
    trained = {ld[0].order for ld in _training_loaders(ranks)}
    for record in ranks:
        for fetch in record.fetches:
            if fetch.loader in trained and fetch.batch >= 1:
                fetched[(fetch.loader, fetch.epoch, fetch.batch)].append(
                    (record.rank, fetch.rng_before, fetch.drew)
                )
    for (loader, epoch, batch), seen in sorted(fetched.items()):
        if len(seen) != len(ranks) or not all(drew for _, _, drew in seen):
            continue
        for group in _groups([rng for _, rng, _ in seen]):
            found.append(
                Finding(
                    "same-seed",
                    "every rank draws the same random augmentations: fetching a batch draws "
                    "from torch's generator, seeded alike on every rank",
                    f"ranks {group} had identical generator states when fetching batch {batch} "
                    f"of epoch {epoch} (DataLoader #{loader}), and fetching it drew random "
                    "numbers",
                    "seed each rank differently after building the model: "
                    "torch.manual_seed(seed + rank)",
                )
            )
            return
