"""Property 4: many iterations, changing unused patterns, optimizer steps in between.

A ``RuleBasedStateMachine`` drives W ranks on one long-lived fake world. Rules: a synced
backward, a local (no-sync) backward, an optimizer step; each backward draws which optional
branches each rank runs. Two references run beside it, in the main thread:

- *mirrors*: one plain model per rank and replica, fed the same inputs, whose gradients are
  replaced at each synced step by the exact rank-order average computed from their own local
  gradients. The ranks must hold exactly the mirrors' gradients and parameters, bit for bit.
- a *single process* that trains one model on every rank's data (loss summed over all ranks and
  replicas, gradients divided by W at each sync). It sums in another order, so the ranks'
  parameters must match it within a tolerance: rtol 1e-4 for float32, 1e-9 for float64.
"""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from torch import Tensor, nn

import fakepg
import reducer

from .harness import active_branches, snapshot
from .model import ModelSpec, branch_inputs, build_model, loss_of, sparse_flags
from .reference import rank_order_average, sparse_average
from .strategies import bucket_assignments, model_specs, unused_patterns

LR = 0.125
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-9}


class TrainingMachine(RuleBasedStateMachine):
    @initialize(
        spec=model_specs(max_branches=3, max_params=6),
        world_size=st.integers(1, 4),
        replicas=st.integers(1, 2),
        find_unused=st.booleans(),
        as_view=st.booleans(),
        data=st.data(),
    )
    def setup(
        self,
        spec: ModelSpec,
        world_size: int,
        replicas: int,
        find_unused: bool,
        as_view: bool,
        data: st.DataObject,
    ) -> None:
        self.spec, self.world_size, self.replicas = spec, world_size, replicas
        self.find_unused = find_unused
        self.world = fakepg.World(world_size, timeout=20.0)
        self.models = [[build_model(spec) for _ in range(replicas)] for _ in range(world_size)]
        self.sparse = sparse_flags(self.models[0][0])
        params0 = list(self.models[0][0].parameters())
        buckets = data.draw(bucket_assignments(params0, self.sparse))
        self.reducers = [
            reducer.Reducer(
                [list(m.parameters()) for m in models],
                buckets,
                self.world.group(r),
                [self.sparse] * replicas,
                gradient_as_bucket_view=as_view,
            )
            for r, models in enumerate(self.models)
        ]
        self.mirrors = [[build_model(spec) for _ in range(replicas)] for _ in range(world_size)]
        self.used = [[[False] * len(params0) for _ in range(replicas)] for _ in range(world_size)]
        for r, models in enumerate(self.mirrors):
            for d, model in enumerate(models):
                for i, p in enumerate(model.parameters()):
                    p.register_post_accumulate_grad_hook(
                        lambda _p, r=r, d=d, i=i: self.used[r][d].__setitem__(i, True)
                    )
        self.single = build_model(spec)
        self.single_used = [False] * len(params0)
        for i, p in enumerate(self.single.parameters()):
            p.register_post_accumulate_grad_hook(
                lambda _p, i=i: self.single_used.__setitem__(i, True)
            )
        self.step = 0
        self.local_since_sync = 0
        self.synced_since_step = False

    def teardown(self) -> None:
        if hasattr(self, "world"):
            for red in self.reducers:
                red.close()
            self.world.close()

    # -- rules --------------------------------------------------------------------------------

    def _patterns(self, data: st.DataObject, synced: bool) -> tuple[frozenset[int], ...]:
        all_used = synced and not self.find_unused
        return data.draw(unused_patterns(self.spec, self.world_size, 1, synced_all_used=all_used))[
            0
        ]

    def _active(self, pattern: tuple[frozenset[int], ...], rank: int) -> frozenset[int]:
        return active_branches(self.spec, pattern[rank])

    def _inputs(self, rank: int, replica: int) -> list[Tensor]:
        seed = (self.spec.seed * 7919 + self.step * 104729 + rank * 31 + replica) % (2**31)
        return branch_inputs(self.spec, seed)

    def _backward(self, pattern: tuple[frozenset[int], ...], synced: bool) -> None:
        def rank_fn(pg: fakepg.FakeProcessGroup) -> None:
            r = pg.rank()
            outputs: list[Tensor] = []
            for d, model in enumerate(self.models[r]):
                outputs += model(self._inputs(r, d), self._active(pattern, r))
            if synced:
                self.reducers[r].prepare_for_backward(outputs if self.find_unused else [])
            loss_of(outputs).backward()

        self.world.run(rank_fn)
        for r, models in enumerate(self.mirrors):
            for d, model in enumerate(models):
                loss_of(model(self._inputs(r, d), self._active(pattern, r))).backward()
        single_loss = torch.zeros((), dtype=torch.float64)
        for r in range(self.world_size):
            for d in range(self.replicas):
                single_loss = single_loss + loss_of(
                    self.single(self._inputs(r, d), self._active(pattern, r))
                )
        single_loss.backward()
        self.step += 1

    # Each window of backward passes starts from zeroed (or None) gradients: the single process
    # reference divides everything accumulated in a window by W, which is what the ranks
    # compute only when no older gradient sits in .grad.

    @precondition(lambda self: not self.synced_since_step)
    @rule(data=st.data())
    def synced_backward(self, data: st.DataObject) -> None:
        self._backward(self._patterns(data, synced=True), synced=True)
        self._sync_references()
        self._check_grads()
        self.local_since_sync = 0
        self.synced_since_step = True

    @precondition(lambda self: not self.synced_since_step and self.local_since_sync < 2)
    @rule(data=st.data())
    def local_backward(self, data: st.DataObject) -> None:
        self._backward(self._patterns(data, synced=False), synced=False)
        self.local_since_sync += 1

    @precondition(lambda self: self.synced_since_step and self.local_since_sync == 0)
    @rule(set_to_none=st.booleans())
    def optimizer_step(self, set_to_none: bool) -> None:
        for model in (
            [m for ms in self.models for m in ms]
            + [m for ms in self.mirrors for m in ms]
            + [self.single]
        ):
            _sgd(model, set_to_none)
        self.synced_since_step = False

    # -- references ---------------------------------------------------------------------------

    def _sync_references(self) -> None:
        """Give the mirrors and the single model what a synced step must produce."""
        count = len(self.sparse)
        for i in range(count):
            column = [
                snapshot(list(self.mirrors[r][d].parameters())[i].grad)
                if self.used[r][d][i]
                else None
                for r in range(self.world_size)
                for d in range(self.replicas)
            ]
            if all(g is None for g in column):
                continue  # unused everywhere: every .grad stays as it is
            if self.sparse[i]:
                # The sparse sum's order is not fixed: check the ranks' result against the
                # exact dense value with a tolerance, then adopt it.
                value = list(self.models[0][0].parameters())[i].grad
                assert value is not None and value.is_sparse, f"parameter {i}: not sparse"
                want = sparse_average(column, self.world_size)
                scale = float(want.abs().max()) if want.numel() else 0.0
                torch.testing.assert_close(value.to_dense(), want, rtol=1e-6, atol=1e-6 * scale)
            else:
                average = rank_order_average(column, self.world_size)
                assert average is not None
                value = average
            for models in self.mirrors:
                for model in models:
                    list(model.parameters())[i].grad = snapshot(value)
        for i, p in enumerate(self.single.parameters()):
            if self.single_used[i] and p.grad is not None:
                p.grad = p.grad / self.world_size
        self.used = [
            [[False] * count for _ in range(self.replicas)] for _ in range(self.world_size)
        ]
        self.single_used = [False] * count

    def _check_grads(self) -> None:
        for r, models in enumerate(self.models):
            for d, model in enumerate(models):
                mirror = self.mirrors[r][d]
                for (name, p), q in zip(model.named_parameters(), mirror.parameters(), strict=True):
                    where = f"step {self.step}, rank {r}, replica {d}, {name}"
                    assert (p.grad is None) == (q.grad is None), f"{where}: grad presence differs"
                    if p.grad is not None and q.grad is not None:
                        assert torch.equal(_dense(p.grad), _dense(q.grad)), (
                            f"{where}: gradient differs from the exact reference"
                        )

    @invariant()
    def parameters_agree(self) -> None:
        if not hasattr(self, "world"):
            return
        single = dict(self.single.named_parameters())
        for r, models in enumerate(self.models):
            for d, model in enumerate(models):
                for (name, p), q in zip(
                    model.named_parameters(), self.mirrors[r][d].parameters(), strict=True
                ):
                    where = f"step {self.step}, rank {r}, replica {d}, {name}"
                    assert torch.equal(p, q), f"{where}: parameters left the exact reference"
                    tol = TOLERANCE[p.dtype]
                    torch.testing.assert_close(
                        p.detach(),
                        single[name].detach(),
                        rtol=tol,
                        atol=tol,
                        msg=lambda m, where=where: f"{where}: far from the single process: {m}",
                    )


def _dense(t: Tensor) -> Tensor:
    return t.to_dense() if t.is_sparse else t


def _sgd(model: nn.Module, set_to_none: bool) -> None:
    """Plain SGD, ``p -= LR * grad``, the same op on every copy of the model."""
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.add_(p.grad, alpha=-LR)
    model.zero_grad(set_to_none=set_to_none)


TrainingMachine.TestCase.settings = settings(
    settings(), max_examples=max(5, settings().max_examples // 3), stateful_step_count=8
)
test_training_matches_the_references = TrainingMachine.TestCase
