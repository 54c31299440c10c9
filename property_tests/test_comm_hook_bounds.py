"""Lossy comm hooks: what PowerSGD guarantees, as bounds derived from float32 rounding.

Gradients here are chosen matrices C (a loss ``(param * C).sum()`` gives ``param.grad == C``
exactly), one bucket, on a fake world of 1 to 4 ranks; u = 2**-24 is float32's unit roundoff.

Property 1 (a full-rank approximation reconstructs the average). With a rank r >= n for an
n x m gradient (n <= m), P̂ is square; if it were exactly orthogonal, P̂ P̂^T = I and PowerSGD
would return A = (1/W) sum_r M_r itself. The hook computes, in float32, Q_r = M_r^T P̂, sums
them in rank order, divides by W (Q̂), and returns M̂ = P̂ Q̂^T. Standard rounding bounds
(gamma_k = k u / (1 - k u)) give, elementwise,

    |M̂ - A| <= |(P̂ P̂^T - I) A|                          (orthogonalization defect)
             + |P̂| (gamma_n sum_r |P̂^T M_r| + gamma_(W-1) sum_r |Q_r| + u |Q_s|)^T / W
             + gamma_n |P̂| |Q̂|^T                          (rounding of the products)

plus 2**-120 per entry for underflow. With r >= 3 the hook orthogonalizes by Householder QR,
whose computed factor is orthogonal to working precision whatever P's conditioning: the test
also checks ||P̂^T P̂ - I||_F <= 8 n^2.5 u (Higham, Accuracy and Stability, Thm 19.4 and
Lemma 19.3, with the unnamed constant taken as 4). Checked for powerSGD_hook (one n x m
parameter) and batched_powerSGD_hook (the buffer padded to an s x s square, r >= s).

Property 2 (error feedback telescopes). With error feedback, rank r adds its error memory e_t
to its gradient g_t (x_t = fl(g_t + e_t)), every rank applies the same Ĝ_t, and keeps
e_(t+1) = fl(x_t - Ĝ_t). Checked: that recurrence bit for bit, at every compressed step; and
its consequence, for every rank and element,

    |sum_t Ĝ_t - (sum_t g_t - e_T)| <= u sum_t (|x_t| + |e_(t+1)|)

(each step's two roundings). So what was applied never drifts from what was computed by more
than the current error memory: the lost part is not lost, only delayed, which is why error
feedback converges. Averaged over ranks the same holds for the true average gradient.

Property 3 (what is not compressed is averaged exactly). A vector (a bias) is never worth
compressing at a compression rate of 1 or more: next to a matrix in its bucket, without error
feedback, its gradient at a compressed step is the fake world's float32 sum in rank order
divided by W, bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import fakepg
import reducer

U = 2.0**-24  # float32 unit roundoff
UNDERFLOW = 2.0**-120


def gamma(k: int) -> float:
    return k * U / (1 - k * U)


@st.composite
def entries(draw: st.DrawFn, shape: tuple[int, ...]) -> Tensor:
    """A float32 tensor: zeros, or magnitudes in [2**-8, 2**8] (no underflow in products of
    two entries), with exact patterns (all zeros, repeated rows) reachable."""
    magnitude = st.floats(2.0**-8, 2.0**8, width=32)
    value = st.one_of(st.just(0.0), magnitude, magnitude.map(lambda x: -x))
    numel = math.prod(shape)
    values = draw(st.lists(value, min_size=numel, max_size=numel))
    return torch.tensor(values, dtype=torch.float32).reshape(shape)


@dataclass(frozen=True)
class Run:
    """Per rank: per step, the applied gradients and (after the step) the error memory; and
    the P̂ the hook orthogonalized at the last step."""

    grads: list[list[list[Tensor]]]
    errors: list[list[Tensor | None]]
    p_hats: list[Tensor]


def run_hook(
    hook: reducer.CommHook,
    shapes: list[tuple[int, int] | tuple[int]],
    data: list[list[list[Tensor]]],
    **state_kwargs: object,
) -> Run:
    """``data[rank][step][param]`` is each gradient; one bucket of every parameter. P̂ is the
    last step's (the state keeps it with warm_start)."""
    world_size, steps = len(data), len(data[0])

    def rank_main(
        pg: fakepg.FakeProcessGroup,
    ) -> tuple[list[list[Tensor]], list[Tensor | None], Tensor]:
        params = [nn.Parameter(torch.zeros(shape)) for shape in shapes]
        state = reducer.PowerSGDState(None, **state_kwargs)  # type: ignore[arg-type]
        grads, errors = [], []
        with reducer.Reducer([params], [list(range(len(params)))], pg) as red:
            red.register_comm_hook(state, hook)
            for step in range(steps):
                for p in params:
                    p.grad = None
                red.prepare_for_backward([])
                mine = data[pg.rank()][step]
                loss = sum((p * c).sum() for p, c in zip(params, mine, strict=True))
                assert isinstance(loss, Tensor)
                loss.backward()
                grads.append([p.grad.clone() for p in params])  # type: ignore[union-attr]
                error = state.error_dict.get(0)
                errors.append(None if error is None else error.clone())
        p_hat = state.p_memory_dict.get(0)
        return grads, errors, torch.empty(0) if p_hat is None else p_hat.clone()

    results = fakepg.run(rank_main, world_size, timeout=30.0)
    return Run([g for g, _, _ in results], [e for _, e, _ in results], [p for _, _, p in results])


# -------------------------------------------------------------------------------------------
# Property 1.


@st.composite
def full_rank_cases(draw: st.DrawFn) -> tuple[str, int, tuple[int, int], list[Tensor]]:
    """(hook, rank r, (n, m), per-rank matrices) with the approximation square and r >= 3."""
    batched = draw(st.booleans())
    world_size = draw(st.integers(1, 4))
    if batched:
        n = draw(st.integers(1, 6))
        m = draw(st.integers(max(1, math.ceil(5 / n)), 8))  # s = ceil(sqrt(n m)) >= 3
        side = math.ceil(math.sqrt(n * m))
        rank = draw(st.integers(side, side + 2))
    else:
        n = draw(st.integers(3, 6))
        m = draw(st.integers(n, 8))
        rank = draw(st.integers(n, n + 2))
    matrices = [draw(entries((n, m))) for _ in range(world_size)]
    return ("batched" if batched else "layer-wise"), rank, (n, m), matrices


@settings(max_examples=2 * settings().max_examples)
@given(full_rank_cases())
def test_a_full_rank_approximation_reconstructs_the_average_within_rounding(
    case: tuple[str, int, tuple[int, int], list[Tensor]],
) -> None:
    kind, rank, (n, m), matrices = case
    world_size = len(matrices)
    hook = reducer.batched_powerSGD_hook if kind == "batched" else reducer.powerSGD_hook
    run = run_hook(  # two steps of warm-up, then the compressed one (the last)
        hook,
        [(n, m)],
        [[[c]] * 3 for c in matrices],
        matrix_approximation_rank=rank,
        start_powerSGD_iter=2,
        min_compression_rate=0,
        use_error_feedback=False,
        warm_start=True,
    )
    got = run.grads[0][2][0].double()
    for r in range(1, world_size):
        assert torch.equal(run.grads[r][2][0], run.grads[0][2][0])  # the same bits everywhere

    if kind == "batched":  # the flat buffer as an s x s square, zero-padded
        side = math.ceil(math.sqrt(n * m))

        def square(c: Tensor) -> Tensor:
            flat = torch.zeros(side * side, dtype=torch.float64)
            flat[: n * m] = c.reshape(-1).double()
            return flat.view(side, side)

        ms = [square(c) for c in matrices]
        got = square(got)
    else:
        ms = [c.double() for c in matrices]
    p_hat = run.p_hats[0].double().reshape(ms[0].shape[0], -1)
    k = p_hat.shape[0]
    assert p_hat.shape == (k, k), "the approximation should be square"
    a = sum(ms, torch.zeros_like(ms[0])) / world_size

    defect = torch.linalg.matrix_norm(p_hat.T @ p_hat - torch.eye(k, dtype=torch.float64))
    note(f"{kind}: n={n} m={m} rank={rank} W={world_size}, ||P^T P - I||_F = {defect:.3g}")
    assert defect <= 8 * k**2.5 * U

    q_r = [mr.T @ p_hat for mr in ms]  # the float32 products, up to their own rounding
    q_s = sum((q.abs() for q in q_r), torch.zeros_like(q_r[0]))
    e_q = (
        gamma(k) * sum((mr.abs().T @ p_hat.abs() for mr in ms), torch.zeros_like(q_s))
        + gamma(max(world_size - 1, 0)) * q_s
        + U * q_s
    ) / world_size
    q_hat = sum(q_r, torch.zeros_like(q_r[0])).abs() / world_size + e_q
    bound = (
        ((p_hat @ p_hat.T - torch.eye(k, dtype=torch.float64)) @ a).abs()
        + p_hat.abs() @ e_q.T
        + gamma(k) * p_hat.abs() @ q_hat.T
    ) * (1 + 1e-6) + UNDERFLOW
    error = (got - a).abs()
    note(f"largest error {error.max():.3g}, largest bound {bound.max():.3g}")
    assert bool((error <= bound).all()), (error - bound).max()


# -------------------------------------------------------------------------------------------
# Property 2.


@st.composite
def feedback_cases(
    draw: st.DrawFn,
) -> tuple[int, list[tuple[int, int] | tuple[int]], list[list[list[Tensor]]]]:
    """(rank, shapes, data[rank][step][param]): a matrix PowerSGD compresses and a vector it
    does not, 1 to 4 ranks, 2 warm-up steps then 1 to 4 compressed ones."""
    world_size = draw(st.integers(1, 4))
    steps = 2 + draw(st.integers(1, 4))
    n = draw(st.integers(2, 5))
    m = draw(st.integers(2, 6))
    shapes: list[tuple[int, int] | tuple[int]] = [(n, m), (n,)]
    rank = draw(st.integers(1, 3))
    data = [
        [[draw(entries(shape)) for shape in shapes] for _ in range(steps)]
        for _ in range(world_size)
    ]
    return rank, shapes, data


@pytest.mark.slow
@given(feedback_cases())
def test_error_feedback_telescopes_so_nothing_is_lost(
    case: tuple[int, list[tuple[int, int] | tuple[int]], list[list[list[Tensor]]]],
) -> None:
    rank, shapes, data = case
    world_size, steps = len(data), len(data[0])
    run = run_hook(
        reducer.powerSGD_hook,
        shapes,
        data,
        matrix_approximation_rank=rank,
        start_powerSGD_iter=2,
        min_compression_rate=0,
        use_error_feedback=True,
        warm_start=True,
        # Against 0 / 0 for a column of zeros (a zero gradient), as torch advises.
        orthogonalization_epsilon=1e-8,
    )

    def flat(tensors: list[Tensor]) -> Tensor:
        return torch.cat([t.reshape(-1) for t in tensors])

    total = sum(math.prod(s) for s in shapes)
    mean_drift = torch.zeros(total, dtype=torch.float64)
    mean_rounding = torch.zeros(total, dtype=torch.float64)
    for r in range(world_size):
        applied_sum = torch.zeros(total, dtype=torch.float64)
        true_sum = torch.zeros(total, dtype=torch.float64)
        rounding = torch.zeros(total, dtype=torch.float64)
        memory = torch.zeros(total, dtype=torch.float32)  # e_0 = 0
        for step in range(2, steps):
            g = flat(data[r][step])
            applied = flat(run.grads[r][step])
            assert torch.equal(applied, flat(run.grads[0][step]))  # every rank applies it
            x = g + memory  # what the hook compresses: float32, as it adds
            after = run.errors[r][step]
            assert after is not None
            assert torch.equal(after, x - applied), f"rank {r}, step {step}: e != x - G"
            applied_sum += applied.double()
            true_sum += g.double()
            rounding += U * (x.double().abs() + after.double().abs())
            memory = after
        drift = applied_sum - (true_sum - memory.double())
        assert bool((drift.abs() <= rounding * (1 + 1e-6)).all()), (
            r,
            (drift.abs() - rounding).max(),
        )
        mean_drift += drift / world_size
        mean_rounding += rounding / world_size
    # Averaged over ranks: the applied sum is the true average's sum less the mean memory.
    assert bool((mean_drift.abs() <= mean_rounding * (1 + 1e-6)).all())


# -------------------------------------------------------------------------------------------
# Property 3.


@st.composite
def bias_cases(
    draw: st.DrawFn,
) -> tuple[int, float, list[tuple[int, int] | tuple[int]], list[list[list[Tensor]]]]:
    """(rank, min_compression_rate, shapes, data[rank][step][param]): a matrix and a vector
    (a bias) in one bucket, in either order; a compression rate of 1 or more (torch's default
    2), at which a vector (k x 1 at rank 1: k + 1 numbers for k) is never worth compressing,
    while the matrix may be; 1 to 4 ranks, 2 warm-up steps then a compressed one."""
    world_size = draw(st.integers(1, 4))
    n = draw(st.integers(3, 6))
    m = draw(st.integers(3, 6))
    k = draw(st.integers(1, 6))
    shapes: list[tuple[int, int] | tuple[int]] = [(n, m), (k,)]
    if draw(st.booleans()):
        shapes.reverse()
    rank = draw(st.integers(1, 2))
    rate = draw(st.sampled_from([1.0, 2.0]))
    data = [
        [[draw(entries(shape)) for shape in shapes] for _ in range(3)] for _ in range(world_size)
    ]
    return rank, rate, shapes, data


@given(bias_cases())
def test_a_vector_powersgd_leaves_uncompressed_is_the_exact_average(
    case: tuple[int, float, list[tuple[int, int] | tuple[int]], list[list[list[Tensor]]]],
) -> None:
    """Property 3: at a compressed step, the bias's gradient (left uncompressed, next to a
    matrix in its bucket) is exactly the fake world's float32 sum in rank order divided by W,
    on every rank; the matrix's approximation is the same bits on every rank."""
    rank, rate, shapes, data = case
    world_size = len(data)
    run = run_hook(
        reducer.powerSGD_hook,
        shapes,
        data,
        matrix_approximation_rank=rank,
        start_powerSGD_iter=2,
        min_compression_rate=rate,
        use_error_feedback=False,
        orthogonalization_epsilon=1e-8,  # against 0 / 0 for a zero matrix, as in Property 2
    )
    vector = next(i for i, shape in enumerate(shapes) if len(shape) == 1)
    total = data[0][2][vector].clone()
    for r in range(1, world_size):
        total = total + data[r][2][vector]  # float32, in rank order, as the fake world sums
    expected = total / world_size
    for r in range(world_size):
        assert torch.equal(run.grads[r][2][vector], expected), (r, run.grads[r][2][vector])
        assert torch.equal(run.grads[r][2][1 - vector], run.grads[0][2][1 - vector])
