"""Findings of the same-training verdict (reducer.testing.sametrain) on hand-made evidence:
what it claims and what it leaves alone."""

from __future__ import annotations

from reducer.testing.sametrain._evidence import BackwardEv, ForwardEv, LossEv, RankEvidence
from reducer.testing.sametrain._findings import judge


def rank(r: int, steps: list[int], scale: float, count: int = 4) -> RankEvidence:
    """A rank whose micro-steps take a mean over ``count`` elements, backpropagated x scale;
    ``steps[k]``: the micro-steps of step k."""
    evidence = RankEvidence(r, steps=len(steps))
    for step, micro_steps in enumerate(steps):
        for micro in range(micro_steps):
            evidence.forwards.append(
                ForwardEv(step, micro, f"{r}-{step}-{micro}", count, f"g{r}", (), ())
            )
            loss = LossEv("cross_entropy", "mean", count, 2.0)
            evidence.backwards.append(BackwardEv(step, micro, 2.0 * scale, [loss]))
    return evidence


def test_a_shorter_last_step_is_not_taken_for_a_double_division() -> None:
    # Two steps of 2 micro-steps, then an epoch's last step of 1: the loss / 2 makes it half
    # of one process's, but it is no evidence of dividing twice.
    ranks = [rank(r, [2, 2, 1], 0.5) for r in range(2)]
    verdict = judge(ranks)
    assert verdict.findings == []
    assert any("fewer micro-steps than the usual 2" in n for n in verdict.notes)
    doubled = [rank(r, [2, 2, 1], 0.25) for r in range(2)]
    assert [f.cause for f in judge(doubled).findings] == ["accumulation-scale"]


def test_forwards_without_tensors_are_not_the_same_batches() -> None:
    ranks = [rank(r, [1, 1], 1.0) for r in range(2)]
    for r in ranks:
        for f in r.forwards:
            f.fingerprint = None  # no tensor found in the arguments
    assert judge(ranks).findings == []
