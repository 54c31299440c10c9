"""reducer.tools.whatif: the replay of a profiled backward, exactly; its buckets against DDP's."""

from __future__ import annotations

import pytest
import torch

import fakepg
import reducer
from reducer.stats import IterationStats
from reducer.tools.simulate import models
from reducer.tools.whatif import BackwardProfile, best, bucket_assignment, predict_step, sweep

MIB = 1 << 20
MS = 1_000_000  # ns


def profile(find_unused: bool = False) -> BackwardProfile:
    """Four 1 MiB float32 gradients, ready in reverse order at 1, 2, 3, 4 ms."""
    return BackwardProfile(
        ready_ns=(4 * MS, 3 * MS, 2 * MS, 1 * MS),
        nbytes=(MIB,) * 4,
        dtypes=(torch.float32,) * 4,
        sparse=(False,) * 4,
        forward_ns=10 * MS,
        optimizer_ns=1 * MS,
        tail_ns=MS // 2,
        find_unused=find_unused,
    )


LINK = fakepg.FixedLatency(0.0015)  # 1.5 ms per collective


def test_one_bucket_per_gradient_queues_on_the_link() -> None:
    p = predict_step(profile(), 1.0, 8, LINK)
    assert p.bucket_indices == ((3,), (2,), (1,), (0,))  # in the order they became ready
    assert p.bucket_nbytes == (MIB,) * 4
    assert p.launch_ns == (1 * MS, 2 * MS, 3 * MS, 4 * MS)
    # Each waits for the link: 1 + 1.5 = 2.5, then 4.0, 5.5, 7.0 ms.
    assert p.done_ns == (2_500_000, 4 * MS, 5_500_000, 7 * MS)
    assert (p.backward_ns, p.comm_ns, p.exposed_ns) == (4 * MS, 6 * MS, 3 * MS)
    assert p.step_ns == 1 * MS + 10 * MS + 7 * MS + MS // 2


def test_a_larger_cap_merges_buckets() -> None:
    # A cap given is every bucket's, the first one's too (torch 2.13): 2 MiB buckets close
    # when they reach 2 MiB.
    p = predict_step(profile(), 2.0, 8, LINK)
    assert p.bucket_indices == ((3, 2), (1, 0))
    assert p.launch_ns == (2 * MS, 4 * MS)
    assert p.done_ns == (3_500_000, 5_500_000)
    whole = predict_step(profile(), 100.0, 8, LINK)
    assert whole.bucket_indices == ((3, 2, 1, 0),)
    assert whole.done_ns == (5_500_000,)
    assert whole.step_ns == 1 * MS + 10 * MS + 5_500_000 + MS // 2


def test_the_default_cap_is_torchs_first_bucket_of_one_mib_then_25() -> None:
    p = predict_step(profile(), None, 8, LINK)
    assert p.bucket_cap_mb is None
    assert p.bucket_indices == ((3,), (2, 1, 0))
    assert p.launch_ns == (1 * MS, 4 * MS)
    assert p.done_ns == (2_500_000, 5_500_000)
    # The same buckets DDP builds when bucket_cap_mb is left unset.
    assert bucket_assignment(profile(), None) == [[3], [2, 1, 0]]
    assert bucket_assignment(profile(), 25.0) == [[3, 2, 1, 0]]


def test_the_model_sets_the_cost_by_bytes_and_world_size() -> None:
    link = fakepg.AlphaBeta(2.0**-20, float(MIB) * 1000, "ring")  # 1 ms per MiB
    p = predict_step(profile(), None, 4, link)
    alpha_ns = 6 * 2.0**-20 * 1e9  # 2 (W - 1) alpha
    # Bucket [3] (1 MiB) launches at 1 ms; [2, 1, 0] (3 MiB) at 4 ms, the link free by then.
    # Bytes cost 2 (W - 1) / W = 1.5 times S / B. Costs are rounded to whole ns.
    assert abs(p.done_ns[0] - (1 * MS + 1.5 * MS + alpha_ns)) <= 1
    assert abs(p.done_ns[1] - (4 * MS + 4.5 * MS + alpha_ns)) <= 1
    # One rank: nothing crosses a link, communication costs nothing.
    alone = predict_step(profile(), 100.0, 1, link)
    assert alone.done_ns == alone.launch_ns and alone.exposed_ns == 0


def test_without_a_network_the_step_is_the_compute() -> None:
    p = predict_step(profile(), 1.0, 64, None)
    assert p.exposed_ns == 0
    assert p.step_ns == 1 * MS + 10 * MS + 4 * MS + MS // 2


def test_find_unused_keeps_reverse_order_buckets_and_adds_the_used_map() -> None:
    p = predict_step(profile(find_unused=True), 2.0, 8, LINK)
    # ddp_bucket_assignment, torch's rule: in parameter order 2 MiB each (a cap given is the
    # first bucket's too); the buckets reversed, each in parameter order.
    assert p.bucket_indices == ((2, 3), (0, 1))
    assert p.done_ns == (3_500_000, 5_500_000)
    assert p.step_ns == 1 * MS + 10 * MS + 7 * MS + MS // 2  # the used map after 5.5 ms
    # The default cap: 1 MiB first (parameter 0 alone), then 25 MiB, reversed.
    default = predict_step(profile(find_unused=True), None, 8, LINK)
    assert default.bucket_indices == ((1, 2, 3), (0,))


def test_sweep_and_best() -> None:
    predictions = sweep(profile(), [1.0, 2.0, 100.0, None], 8, LINK)
    assert [p.bucket_cap_mb for p in predictions] == [1.0, 2.0, 100.0, None]
    # 2, 100 and the default (1 then 25) all end at 5.5 ms, cap 1 at 7 ms: among equals the
    # smallest largest bucket.
    assert [p.step_ns for p in predictions] == [18_500_000] + [17 * MS] * 3
    assert best(predictions).bucket_cap_mb == 2.0
    same = sweep(profile(), [100.0, 50.0], 8, LINK)  # equal steps: the smaller cap
    assert same[0].step_ns == same[1].step_ns and best(same).bucket_cap_mb == 50.0


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="bucket_cap_mb must be >= 0"):
        predict_step(profile(), -1.0, 8, LINK)
    # 0, as DDP takes it: one parameter per bucket.
    one_each = predict_step(profile(), 0.0, 8, LINK)
    assert all(len(b) == 1 for b in one_each.bucket_indices)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        predict_step(profile(), 1.0, 0, LINK)
    with pytest.raises(ValueError, match="no predictions"):
        best([])
    with pytest.raises(ValueError, match="at least one iteration"):
        BackwardProfile.from_iterations([], params=[], forward_ns=[], optimizer_ns=[], sparse=[])


def test_from_iterations_takes_medians() -> None:
    def it(ready: tuple[int, int], done: int, finalize: tuple[int, int]) -> IterationStats:
        return IterationStats(0, (ready,), (ready[1],), (done,), *finalize, (8,), 0)

    iterations = [it((10, 5), 30, (20, 40)), it((12, 7), 25, (30, 31)), it((11, 6), 50, (40, 58))]
    params = [torch.empty(3), torch.empty(5, dtype=torch.float64)]
    p = BackwardProfile.from_iterations(
        iterations,
        params=params,
        forward_ns=[100, 300, 200],
        optimizer_ns=[7, 9, 8],
        sparse=[False, True],
        sparse_nbytes=[0.0, 44.0],
    )
    assert p.ready_ns == (11, 6)
    assert p.nbytes == (12, 44)  # dense: numel x itemsize; sparse: as measured
    assert p.dtypes == (torch.float32, torch.float64)
    assert (p.forward_ns, p.optimizer_ns) == (200, 8)
    assert p.tail_ns == 8  # finalize end minus max(last done, finalize start): 10, 1, 8


@pytest.mark.parametrize(
    ("width", "cap"),
    [(64, 0.02), (512, None), (512, 1.5)],
    ids=["small-cap", "default-cap", "cap-given"],
)
def test_buckets_match_the_ones_ddp_rebuilds(width: int, cap: float | None) -> None:
    """After its first iteration DDP rebuilds buckets in ready order; so does the replay, for
    a cap given (every bucket's limit) and the default (1 MiB first, then 25 MiB)."""
    with fakepg.World(1) as world:
        module = models.build_model("mlp", width, seed=0)
        ddp = reducer.DistributedDataParallel(module, world.group(0), bucket_cap_mb=cap)
        x, y = module.make_batch(torch.Generator().manual_seed(0), 8)
        module.loss(ddp(x), y).backward()
        first_ready = ddp.reducer.backward_stats[0]
        module.loss(ddp(x), y).backward()  # the second forward rebuilt the buckets
        rebuilt = ddp.reducer.bucket_indices
        ddp.reducer.close()
    params = list(module.parameters())
    measured = BackwardProfile(
        ready_ns=tuple(first_ready),
        nbytes=tuple(p.numel() * 4 for p in params),
        dtypes=(torch.float32,) * len(params),
        sparse=(False,) * len(params),
        forward_ns=0,
        optimizer_ns=0,
        tail_ns=0,
    )
    assert len(rebuilt) >= 2
    assert bucket_assignment(measured, cap) == rebuilt
