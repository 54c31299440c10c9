"""Property 10: the replica check (``reducer.tools.check``) gives the exact verdict, no false one.

Training scripts drawn as people write them: torch's DDP or this project's over 2 to 4 ranks
(three often), an optimizer with one parameter group or two (weight decay on the matrices
only, nanoGPT's split), one optimizer step, and one of these (``feature``):

- ``plain``: one Linear layer, a fault in it; or, with no fault, the ranks train a drawn
  number of steps each, under the wrapper's ``join()`` or not (drawn): under it the check
  passes, with a note of the uneven inputs where the counts differ (a check that takes a
  rank that ran out for a stalled one stops a correct run); without it, uneven counts are
  an error (a rank that ran out leaves the others waiting in a reduction), which a check
  that reads the join state from any wrapper's configuration, present or not enabled,
  takes for a correct run. The wrapper may also be a user's own (:class:`OwnDDP`): a
  subclass of torch's DDP, so that tools take it for one, that reduces by itself and has
  none of torch's state, no join configuration among it: the check reads what a wrapper
  has, so it gives the same verdicts (a check that needs a join configuration fails);
- ``zero``: ``ZeroRedundancyOptimizer`` over two blocks of equal shapes: each rank's inner
  optimizer steps its own shard, so comparing the shards by position reports blocks that
  are not replicas (the whole model is compared, every parameter of it);
- ``ignored``: a parameter that differs per rank by design, excluded with
  ``_set_params_and_buffers_to_ignore_for_model``: never compared, even with a fault in it;
- ``frozen``: a frozen layer (``requires_grad=False``, outside the optimizer) whose weights a
  drawn set of ranks loads after wrapping: diverged at ``0.weight`` where some ranks but not
  all loaded them (nothing reduces or steps it: only the check sees it);
- ``siamese``: micro-steps of one to three forwards of the wrapper before each backward: one
  backward with several forwards is one reduction, not waste; two backwards are waste, named
  with their count;
- ``summed``: two heads of one shape, each rank running the one it draws, with
  ``find_unused_parameters`` and a bucket per parameter, and ``skip_all_reduce_unused_params``
  drawn: where the ranks ran different heads and skip, torch's DDP pairs different buckets,
  and the check proves it (the cause names each rank's head, bit for bit); this project's DDP
  refuses that pass before reducing.

With one rank's gradient of one trained parameter moved by one unit in the last place after
the reduction (``fault``, two times in three, except ``summed``), the check must stop with
"gradients differ" at that parameter and say that it cannot tell why (no average of local
gradients gives it), unless the parameter is ignored (then nothing is wrong). A check that
compares with a tolerance, reads only the first parameter group, skips frozen parameters,
compares ZeRO's shards, compares ignored parameters, counts forwards as micro-steps or
blames the summed bucket on a generic cause gives another verdict.
"""

from __future__ import annotations

import contextlib
import io
import threading
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st
from torch import nn

import reducer
from reducer.testing.harness import note_size
from reducer.tools.check import ReplicaCheck, run_checked

FEATURES = ("plain", "zero", "ignored", "frozen", "siamese", "summed")

# The trained parameters of each feature's model, in model order (what ``fault`` indexes), and
# how many parameters the check compares at a step (the frozen layer's weight too).
TRAINED: dict[str, tuple[str, ...]] = {
    "plain": ("weight", "bias"),
    "zero": ("0.weight", "2.weight"),  # two blocks of equal shapes
    "ignored": ("body.weight", "body.bias", "own.scale"),  # own.scale: ignored, per rank
    "frozen": ("2.weight", "2.bias"),  # after the frozen 0.weight
    "siamese": ("weight", "bias"),
    "summed": ("trunk.weight", "left.weight", "right.weight"),
}
_IGNORED = "own.scale"
_BUILD = threading.Lock()
_COMPARED = {"plain": 2, "zero": 2, "ignored": 2, "frozen": 3, "siamese": 2, "summed": 3}


@dataclass(frozen=True)
class CheckScenario:
    """One optimizer step (or, under ``joined``, a drawn number per rank). ``fault``: None,
    or (rank, index into the feature's trained parameters) whose gradient that rank moves
    one ulp up before the optimizer step."""

    kind: str  # "torch", "ours" or "user" (OwnDDP; plain only)
    world_size: int
    groups: int  # 1, or 2: weight decay on the matrices only
    fault: tuple[int, int] | None
    joined: tuple[int, ...] | None = None  # per rank, its steps (no fault)
    feature: str = "plain"  # see FEATURES and the module's docstring
    loaded: tuple[int, ...] = ()  # frozen: the ranks that load its weights after wrapping
    micro: tuple[int, ...] = (1,)  # forwards of the wrapper before each backward
    heads: tuple[int, ...] = ()  # summed: per rank, the head it runs (0: left, 1: right)
    skip: bool = False  # summed: skip_all_reduce_unused_params
    join: bool = True  # with joined: the steps run under the wrapper's join()

    @property
    def parameters(self) -> int:
        """Parameters of the model, frozen ones included."""
        return len(TRAINED[self.feature]) + (self.feature == "frozen")


@st.composite
def check_scenarios(draw: st.DrawFn, features: tuple[str, ...] = FEATURES) -> CheckScenario:
    """Scenarios of the replica check (see the module's docstring); ``features``: those
    drawn (the first is what a failing example shrinks to)."""
    world = draw(st.sampled_from([2, 3, 3, 4]))
    feature = draw(st.sampled_from(features))
    kind = draw(
        st.sampled_from(["torch", "ours", "user"] if feature == "plain" else ["torch", "ours"])
    )
    fault = None
    if feature != "summed" and draw(st.sampled_from([True, True, False])):  # two in three
        fault = (draw(st.integers(0, world - 1)), draw(st.integers(0, len(TRAINED[feature]) - 1)))
    joined = None
    join = True
    if feature == "plain" and fault is None:  # the one step without a fault: see siamese
        join = kind != "user" and draw(st.booleans())  # a user's wrapper has no join()
        # Without join(), two synced steps at least: torch's DDP rebuilds its buckets (a
        # collective) at its second forward even under no_sync.
        joined = tuple(draw(st.integers(1 if join else 2, 3)) for _ in range(world))
    loaded: tuple[int, ...] = ()
    if feature == "frozen":  # rank 0 only (the usual mistake), none, every rank, or some
        loaded = draw(
            st.sampled_from([(0,), (), tuple(range(world)), None]).flatmap(
                lambda ranks: (
                    st.just(ranks)
                    if ranks is not None
                    else st.sets(st.integers(0, world - 1)).map(lambda r: tuple(sorted(r)))
                )
            )
        )
    micro = (1,)
    if feature == "siamese":  # one backward two times in three; a siamese pair first
        backwards = draw(st.sampled_from([1, 1, 2]))
        micro = tuple(draw(st.sampled_from([2, 1, 3])) for _ in range(backwards))
    heads: tuple[int, ...] = ()
    skip = False
    if feature == "summed":
        heads = tuple(draw(st.integers(0, 1)) for _ in range(world))
        skip = draw(st.booleans())
    return CheckScenario(
        kind,
        world,
        1 if feature == "zero" else draw(st.sampled_from([2, 1])),
        fault,
        joined,
        feature,
        loaded,
        micro,
        heads,
        skip,
        join,
    )


class _Scale(nn.Module):
    """A parameter of its own per rank (a per-rank embedding, say)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((2,), 1.0 + rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class _WithOwnScale(nn.Module):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.body = nn.Linear(3, 2)
        # In a submodule: torch's DDP does not find an ignored name of the root module's own
        # parameters when it builds its reducer.
        self.own = _Scale(rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.own(self.body(x))  # type: ignore[no-any-return]


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(3, 4, bias=False)
        self.left, self.right = nn.Linear(4, 2, bias=False), nn.Linear(4, 2, bias=False)

    def forward(self, x: torch.Tensor, left: bool) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        return self.left(h) if left else self.right(h)  # type: ignore[no-any-return]


class OwnDDP(nn.parallel.DistributedDataParallel):
    """A user's own data-parallel wrapper: a subclass of torch's DDP (for the tools that
    ask ``isinstance``) without torch's constructor, so without its state (no reducer, no
    join configuration; it has no ``join()``). Each gradient, once accumulated, is scaled by
    1/W and allreduced at once, unless its forward ran under ``no_sync()`` (torch's, which
    it inherits: it sets ``require_backward_grad_sync``)."""

    def __init__(self, module: nn.Module, pg: Any) -> None:
        nn.Module.__init__(self)
        self.module, self.pg = module, pg
        self.require_backward_grad_sync = True
        self.sync = True
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._reduce)  # type: ignore[no-untyped-call]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.sync = self.require_backward_grad_sync and torch.is_grad_enabled()
        return self.module(*args, **kwargs)

    def _reduce(self, p: torch.Tensor) -> None:
        assert p.grad is not None
        if self.sync:
            p.grad.mul_(1.0 / self.pg.size())
            self.pg.allreduce([p.grad]).wait()


def _model(s: CheckScenario, rank: int) -> tuple[nn.Module, dict[str, Any]]:
    """The feature's model (seeded alike on every rank) and the wrapper's arguments."""
    with _BUILD:  # torch's default generator is shared by the rank threads
        torch.manual_seed(0)
        return _build(s, rank)


def _build(s: CheckScenario, rank: int) -> tuple[nn.Module, dict[str, Any]]:
    if s.feature == "zero":
        blocks = nn.Linear(3, 3, bias=False), nn.Tanh(), nn.Linear(3, 3, bias=False)
        return nn.Sequential(*blocks), {}
    if s.feature == "ignored":
        model = _WithOwnScale(rank)
        ddp = nn.parallel.DistributedDataParallel
        ddp._set_params_and_buffers_to_ignore_for_model(model, [_IGNORED])
        return model, {}
    if s.feature == "frozen":
        model = nn.Sequential(nn.Linear(3, 3, bias=False), nn.Tanh(), nn.Linear(3, 2))
        model[0].requires_grad_(False)
        return model, {}
    if s.feature == "summed":
        options = {
            "find_unused_parameters": True,
            "bucket_cap_mb": 1e-5,
            "skip_all_reduce_unused_params": s.skip,
        }
        return _TwoHeads(), options
    return nn.Linear(3, 2), {}


def _optimizer(s: CheckScenario, trained: list[nn.Parameter]) -> torch.optim.Optimizer:
    if s.feature == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(trained, torch.optim.SGD, lr=0.1)
    if s.groups == 1:
        return torch.optim.SGD(trained, lr=0.1)
    decay = [p for p in trained if p.dim() >= 2]
    rest = [p for p in trained if p.dim() < 2]
    return torch.optim.SGD(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=0.1
    )


def _batch(rank: int, step: int, micro: int = 0, forward: int = 0) -> torch.Tensor:
    seed = 100 * rank + 10 * step + 3 * micro + forward
    return torch.randn(2, 3, generator=torch.Generator().manual_seed(seed))


def _train(s: CheckScenario) -> Any:
    def train(pg: Any) -> None:
        rank = pg.rank()
        model, options = _model(s, rank)
        if s.kind == "user":
            ddp: Any = OwnDDP(model, pg)
        elif s.kind == "torch":
            ddp = nn.parallel.DistributedDataParallel(model, **options)
        else:
            ddp = reducer.DistributedDataParallel(model, **options)
        if rank in s.loaded:  # pretrained weights of the frozen layer, after wrapping
            weights = torch.randn(3, 3, generator=torch.Generator().manual_seed(7))
            with torch.no_grad():
                model[0].weight.copy_(weights)
        trained = [p for p in model.parameters() if p.requires_grad]
        optimizer = _optimizer(s, trained)
        if s.joined is not None:
            with ddp.join() if s.join else contextlib.nullcontext():
                for k in range(s.joined[rank]):
                    # Without join(), the steps past the fewest are local (no_sync): the
                    # ranks with more step alone, the others have ended.
                    local = not s.join and k >= min(s.joined)
                    with ddp.no_sync() if local else contextlib.nullcontext():
                        ddp(_batch(rank, k)).square().mean().backward()
                    optimizer.step()
                    optimizer.zero_grad()
            return
        for m, forwards in enumerate(s.micro):
            if s.feature == "summed":
                outputs = [ddp(_batch(rank, 0), left=s.heads[rank] == 0)]
            else:
                outputs = [ddp(_batch(rank, 0, m, k)) for k in range(forwards)]
            # A loss that joins every forward's output (a siamese pair's, say).
            sum((out * (k + 1)).square().mean() for k, out in enumerate(outputs)).backward()
        if s.fault is not None and s.fault[0] == rank:
            grad = trained[s.fault[1]].grad
            assert grad is not None
            grad.copy_(torch.nextafter(grad, torch.full_like(grad, float("inf"))))
        optimizer.step()

    return train


@dataclass(frozen=True)
class Verdict:
    """What the check must say: its findings as (level, title), in order, words the first
    of them must contain, and (in sync) how many parameters it compares and ignores."""

    findings: tuple[tuple[str, str], ...]
    words: tuple[str, ...] = ()
    compared: int | None = None
    ignored: int = 0


def _summed(s: CheckScenario) -> bool:
    return s.feature == "summed" and s.skip and len(set(s.heads)) > 1


def expected(s: CheckScenario) -> Verdict:
    """The right verdict on ``s``, from the scenario alone."""
    names = TRAINED[s.feature]
    if s.fault is not None and names[s.fault[1]] != _IGNORED:
        # The trained parameters come first, so a fault is found before a frozen layer.
        return Verdict(
            (("error", "gradients differ"),),
            (f"gradient of {names[s.fault[1]]!r} differs", "the check cannot tell why"),
        )
    if s.feature == "frozen" and 0 < len(s.loaded) < s.world_size:
        return Verdict(
            (("error", "parameters differ"),),
            ("parameter '0.weight' differs before optimizer step 0", "It is frozen"),
        )
    if _summed(s):  # torch's DDP (this project's refuses it: see check_replica_check)
        left = s.heads.index(0)
        parts = ", ".join(
            f"rank {r}'s {('left', 'right')[head] + '.weight'!r}" for r, head in enumerate(s.heads)
        )
        return Verdict(
            (("error", "gradients differ"),),
            (
                "gradient of 'left.weight' differs before optimizer step 0",
                f"The reduction summed different parameters across ranks: rank {left}'s "
                f"'left.weight' is bit for bit the average of {parts}.",
                "skip_all_reduce_unused_params=True",
            ),
        )
    ignored = int(s.feature == "ignored")
    if len(s.micro) > 1:
        return Verdict(
            (("warning", "redundant reductions"),),
            (f"reduced gradients on {len(s.micro)} micro-steps before optimizer step 0",),
            _COMPARED[s.feature],
            ignored,
        )
    if s.joined is not None and len(set(s.joined)) > 1 and not s.join:
        fewest = min(s.joined)
        return Verdict(
            (("error", "ranks stepped differently"),),
            (f"optimizer step {fewest}",),
        )
    if s.joined is not None and len(set(s.joined)) > 1:
        return Verdict((("note", "uneven inputs"),), ("uneven inputs",), _COMPARED[s.feature])
    return Verdict((), (), _COMPARED[s.feature], ignored)


def check_replica_check(s: CheckScenario) -> None:
    """The property: the check's findings, the words of the first, the count of parameters
    it compares and ignores, and its summary's verdict are the expected ones."""
    if _summed(s) and s.kind == "ours":
        # This project's DDP refuses the pass before reducing anything: the ranks agree on
        # what they skip.
        with pytest.raises(reducer.ReducerError, match="needs the same parameters unused"):
            run_checked(_train(s), world_size=s.world_size, timeout=20, out=io.StringIO())
        return
    check = run_checked(_train(s), world_size=s.world_size, timeout=20, out=io.StringIO())
    want = expected(s)
    got = tuple((f.level, f.title) for f in check.findings)
    assert got == want.findings, (s, check.findings)
    if want.words:
        text = " ".join(check.findings[0].text.split())
        for words in want.words:
            assert words in text, (words, text)
    verdict = _verdict_line(check)
    if any(level == "error" for level, _ in want.findings):
        step = min(s.joined) if s.joined is not None else 0
        assert verdict.startswith(f"verdict: RANKS DIVERGED at optimizer step {step} ({got[0][1]})")
        return
    assert verdict == "verdict: the ranks stayed in sync", check.summary()
    assert (check.compared, check.ignored, check.sharded) == (want.compared, want.ignored, 0), (
        check.summary()
    )


def _verdict_line(check: ReplicaCheck) -> str:
    return check.summary().rsplit("\n", 1)[-1]


@pytest.mark.slow
@pytest.mark.parametrize("feature", FEATURES)
@given(data=st.data())
def test_the_replica_check_gives_the_exact_verdict(feature: str, data: st.DataObject) -> None:
    # One test per feature: each gets the profile's examples.
    s = data.draw(check_scenarios((feature,)))
    note_size(s.parameters, s.world_size)
    event(f"{s.kind}, {s.world_size} ranks, {s.groups} group(s), fault: {s.fault is not None}")
    if s.feature == "frozen":
        event(f"frozen, loaded on some ranks only: {0 < len(s.loaded) < s.world_size}")
    if s.feature == "siamese":
        event(f"several forwards before a backward: {max(s.micro) > 1}; backwards: {len(s.micro)}")
    if s.feature == "summed":
        event(f"summed bucket: {_summed(s)}")
    if s.joined is not None:
        event(f"under join(): {s.join}, uneven inputs: {len(set(s.joined)) > 1}")
        event(f"{s.kind}'s wrapper, uneven inputs: {len(set(s.joined)) > 1}")
    check_replica_check(s)
