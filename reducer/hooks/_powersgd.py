"""PowerSGD gradient compression as comm hooks: torch's ``powerSGD_hook``, over any ProcessGroup.

A port of ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`` (Vogels et al.,
"PowerSGD", NeurIPS 2019) to the reducer's :class:`reducer.ProcessGroup` protocol and
:class:`reducer.GradBucket`, with the same state, hyperparameters and arithmetic (the same
bits, given the same reduction). Each matrix-shaped gradient M (a parameter's gradient viewed
as ``shape[0] x rest``) worth compressing is replaced by a rank-``r`` approximation P Q^T,
where P = orth(sum_ranks M Q) and Q = sum_ranks M^T P / W: two allreduces of (n + m) r numbers
instead of one of n m. The other gradients (vectors, small matrices) are allreduced as they
are. With error feedback, what compression lost on a rank is added to its next gradient.

Differences from torch, each for the same reason (see Note [Collectives of a hook are issued
from the hook] in reducer.comm_hook): the hook issues its allreduces itself and waits there
for P before it computes and issues Q (torch issues them from future callbacks and blocks in
those); the random initial Q of every rank comes from a generator of the hook's own, seeded as
torch seeds its global one, so that rank threads of one process cannot disturb each other's
draws (the same numbers as torch's). ``batched_powerSGD_hook`` pads a copy of the buffer to a
square instead of resizing the bucket's own, and caps the rank at the square's side.

A state holds one rank's compression memory: give every rank (every process, every fake-world
rank thread) its own :class:`PowerSGDState`.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import Tensor

from reducer.comm_hook import GradBucket, future_of
from reducer.errors import InvalidArgument, ReductionError
from reducer.hooks._default import allreduce_divided, as_process_group
from reducer.process_group import ProcessGroup, ReduceOp

__all__ = ["PowerSGDState", "batched_powerSGD_hook", "powerSGD_hook"]

logger = logging.getLogger(__name__)


class PowerSGDState:
    """The hyperparameters and the per-bucket memory of PowerSGD on one rank (torch's names).

    ``process_group``: the group to reduce over (None: the reducer's own; a torch.distributed
    group is wrapped). ``matrix_approximation_rank``: the rank r of each approximation (lower
    compresses more). ``start_powerSGD_iter``: iterations of plain allreduce before compression
    starts (at least 2 with error feedback or warm start, as in torch: the DDP wrapper rebuilds
    its buckets after the first iteration). ``min_compression_rate``: a matrix n x m is
    compressed only if (n + m) r * min_compression_rate < n m. ``use_error_feedback``: add what
    compression lost to the next gradient. ``warm_start``: start from the last iteration's Q.
    ``orthogonalization_epsilon``: added to column norms, against division by zero.
    ``random_seed``: seeds the initial Qs, the same on every rank. ``batch_tensors_with_same_
    shape``: compress same-shaped gradients of a bucket in one batched product.
    """

    __slots__ = [
        "_rank",
        "batch_tensors_with_same_shape",
        "compression_stats_logging_frequency",
        "error_dict",
        "iter",
        "matrix_approximation_rank",
        "min_compression_rate",
        "next_stats_report",
        "orthogonalization_epsilon",
        "p_memory_dict",
        "process_group",
        "q_memory_dict",
        "rng",
        "start_powerSGD_iter",
        "total_numel_after_compression",
        "total_numel_before_compression",
        "use_error_feedback",
        "warm_start",
    ]

    def __init__(
        self,
        process_group: object,
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 1_000,
        min_compression_rate: float = 2,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0,
        random_seed: int = 0,
        compression_stats_logging_frequency: int = 10_000,
        batch_tensors_with_same_shape: bool = False,
    ) -> None:
        _check_int("matrix_approximation_rank", matrix_approximation_rank, minimum=1)
        _check_int("start_powerSGD_iter", start_powerSGD_iter, minimum=0)
        _check_number("min_compression_rate", min_compression_rate)
        _check_number("orthogonalization_epsilon", orthogonalization_epsilon)
        _check_int("random_seed", random_seed, minimum=0)
        _check_int(
            "compression_stats_logging_frequency", compression_stats_logging_frequency, minimum=0
        )
        if (use_error_feedback or warm_start) and start_powerSGD_iter <= 1:
            # torch's error, word for word: its type and its text are what users search for.
            raise InvalidArgument(
                "Expect `start_powerSGD_iter` > 1 if `use_error_feedback` or `warm_start` is "
                "enabled, because PowerSGD can only be applied after the first two iterations "
                f"in DDP. Got start_powerSGD_iter={start_powerSGD_iter}: the buckets are rebuilt "
                "after the first iteration, which would mix up the memorized tensors. Pass "
                "start_powerSGD_iter >= 2, or use_error_feedback=False and warm_start=False"
            )
        self.process_group = process_group
        self.matrix_approximation_rank = int(matrix_approximation_rank)
        self.start_powerSGD_iter = int(start_powerSGD_iter)
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = bool(use_error_feedback)
        self.warm_start = bool(warm_start)
        self.orthogonalization_epsilon = orthogonalization_epsilon
        # Seeds of the initial Qs: a different one every iteration, the same sequence on every
        # rank (numpy's legacy generator, as torch's state uses).
        self.rng = np.random.RandomState(random_seed)
        # Per bucket index: the local error, and the memory of the low-rank factors.
        self.error_dict: dict[int, Tensor] = {}
        self.p_memory_dict: dict[int, Tensor] = {}
        self.q_memory_dict: dict[int, Tensor] = {}
        self.iter = 0
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0
        self.compression_stats_logging_frequency = max(1, int(compression_stats_logging_frequency))
        self.next_stats_report = 0
        self.batch_tensors_with_same_shape = bool(batch_tensors_with_same_shape)
        self._rank: int | None = None  # the rank that uses this state (set at first use)

    def maybe_increase_iter(self, bucket: GradBucket) -> None:
        """Count an iteration when its last bucket is reduced."""
        if bucket.is_last():
            self.iter += 1
        if self.iter == self.start_powerSGD_iter:
            logger.info("Start to apply PowerSGD after %s iterations.", self.iter)

    def compression_stats(self) -> tuple[float, int, int]:
        """(compression rate, numbers before compression, numbers after), so far."""
        after = self.total_numel_after_compression
        rate = self.total_numel_before_compression / after if after > 0 else 0
        return rate, self.total_numel_before_compression, after

    def __getstate__(self) -> dict[str, Any]:
        """For checkpoints: everything but the process group (restored as None, the reducer's
        own group)."""
        return {slot: getattr(self, slot) for slot in self.__slots__ if slot != "process_group"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.process_group = None
        for slot, value in state.items():
            setattr(self, slot, value)

    def _group(self, bucket: GradBucket) -> ProcessGroup:
        """The group to reduce over; refuses a state shared by several ranks."""
        group = (
            bucket._process_group
            if self.process_group is None
            else as_process_group(self.process_group, "PowerSGDState.process_group")
        )
        rank = group.rank()
        if self._rank is None:
            self._rank = rank
        elif self._rank != rank:
            raise ReductionError(
                f"a PowerSGDState is used by rank {rank} and by rank {self._rank}: it holds one "
                "rank's compression memory. Give every rank its own PowerSGDState"
            )
        return group


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise InvalidArgument(f"PowerSGDState: {name} must be an int >= {minimum}, got {value!r}")


def _check_number(name: str, value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value < 0
    ):
        raise InvalidArgument(f"PowerSGDState: {name} must be a finite number >= 0, got {value!r}")


# -------------------------------------------------------------------------------------------
# The arithmetic, as torch's.


def _orthogonalize(matrices: Tensor, epsilon: float = 0) -> None:
    """Orthonormalize the columns of each matrix of a batch (b x n x r, r <= n), in place:
    Gram-Schmidt for r <= 2 or half precision, QR otherwise."""
    assert matrices.dim() == 3 and matrices.shape[2] <= matrices.shape[1]
    rank = matrices.shape[2]
    if rank <= 2 or matrices.dtype in (torch.float16, torch.bfloat16):
        _orthogonalize_gram_schmidt(matrices, epsilon)
    else:
        r = torch.empty(matrices.shape[0], rank, rank, device=matrices.device, dtype=matrices.dtype)
        torch.linalg.qr(matrices, out=(matrices, r))


def _orthogonalize_gram_schmidt(matrices: Tensor, epsilon: float = 0) -> None:
    num_cols = matrices.shape[2]
    for i in range(num_cols):
        col = matrices[:, :, i : i + 1]
        if epsilon == 0:
            # A column of zeros (a vanishing gradient) gives NaNs here, as in torch; set
            # orthogonalization_epsilon (e.g. 1e-8) when that can happen.
            col /= torch.norm(col, dim=1, keepdim=True)
        else:
            col /= torch.norm(col, dim=1, keepdim=True) + epsilon
        if i + 1 < num_cols:
            rest = matrices[:, :, i + 1 :]
            rest -= torch.sum(col * rest, dim=1, keepdim=True) * col


def _should_compress(
    n: int, m: int, rank: int, min_compression_rate: float
) -> tuple[bool, int, int]:
    """(worth compressing, numbers uncompressed, numbers compressed) for an n x m matrix."""
    uncompressed = n * m
    compressed = (n + m) * rank
    return compressed * min_compression_rate < uncompressed, uncompressed, compressed


def _report_compression_stats(bucket: GradBucket, state: PowerSGDState) -> None:
    if bucket.is_last() and state.iter >= state.next_stats_report:
        rate, before, after = state.compression_stats()
        logger.info(
            "Compression stats: iter %s, total before compression %s, total after compression "
            "%s, rate %s",
            state.iter,
            before,
            after,
            rate,
        )
        state.next_stats_report = state.iter + state.compression_stats_logging_frequency


def _next_generator(state: PowerSGDState) -> torch.Generator:
    """A CPU generator seeded with the state's next seed: it draws the numbers torch's hook
    draws from the global generator after ``manual_seed(seed)``, without touching the global
    one (which the rank threads of a fake world share)."""
    return torch.Generator().manual_seed(int(state.rng.randint(1_000_000_000)))


def _synchronize(device: torch.device) -> None:
    """Decompression may run on a thread other than the one that issued the products."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -------------------------------------------------------------------------------------------
# The hooks.


def powerSGD_hook(state: PowerSGDState, bucket: GradBucket) -> torch.futures.Future[Tensor]:
    """PowerSGD, layer by layer: each parameter's gradient worth compressing (see
    ``min_compression_rate``) is reduced as a rank-r approximation, the others as they are.

    The first ``state.start_powerSGD_iter`` iterations are a plain allreduce (the same bits as
    no hook). Then, per bucket: add the local error (error feedback); allreduce the
    uncompressed gradients (summed, then divided by W); P = M Q for each compressed M (Q random
    and orthogonalized, or last iteration's with warm start), allreduce the Ps, orthogonalize
    them; Q = M^T P, allreduce the Qs and divide by W; M becomes P Q^T; the local error is what
    the rank contributed minus the result.
    """
    group = state._group(bucket)
    world_size = group.size()
    input_tensor = bucket.buffer()
    if state.iter < state.start_powerSGD_iter or input_tensor.is_sparse:
        # Warm-up; and a sparse gradient (nn.Embedding(sparse=True)), which has no matrix
        # to approximate, is always reduced as it is.
        state.maybe_increase_iter(bucket)
        return allreduce_divided(group, input_tensor)

    device, dtype = input_tensor.device, input_tensor.dtype
    bucket_index = bucket.index()
    total_length = input_tensor.shape[0]
    input_tensor_cp: Tensor | None = None
    if state.use_error_feedback:
        if bucket_index in state.error_dict:
            input_tensor.add_(state.error_dict[bucket_index])
        else:
            state.error_dict[bucket_index] = torch.zeros(total_length, device=device, dtype=dtype)
        # What this rank contributes, to compute what compression loses.
        input_tensor_cp = input_tensor.detach().clone()

    # Step I: which gradients to compress (as matrices), which to reduce as they are.
    tensors = bucket.gradients()
    to_compress: list[Tensor] = []
    uncompressed: list[Tensor] = []
    # A gradient laid out otherwise than row-major (channels_last: GradBucket.gradients
    # follows the parameter's strides) is no matrix view of the buffer: its matrix is a
    # row-major copy, written back after decompression.
    copied: list[tuple[Tensor, Tensor]] = []
    total_ps_size = total_qs_size = 0
    for tensor in tensors:
        matrix = tensor.reshape(tensor.shape[0], -1)
        n, m = matrix.shape
        rank = min(n, m, state.matrix_approximation_rank)
        worth, before, after = _should_compress(n, m, rank, state.min_compression_rate)
        state.total_numel_before_compression += before
        if worth:
            if not tensor.is_contiguous():
                copied.append((tensor, matrix))
            to_compress.append(matrix)
            total_ps_size += n * rank
            total_qs_size += m * rank
            state.total_numel_after_compression += after
        else:
            uncompressed.append(tensor)
            state.total_numel_after_compression += before
    _report_compression_stats(bucket, state)

    # Step II: the uncompressed gradients, in one contiguous tensor.
    uncompressed_memory = (
        torch.cat([t.reshape(-1) for t in uncompressed])
        if uncompressed
        else torch.tensor([], device=device, dtype=dtype)
    )

    # Step III: memory for the Ps and Qs (kept between iterations with warm start).
    need_randomize_qs = False
    if not state.warm_start or bucket_index not in state.p_memory_dict:
        need_randomize_qs = True
        state.p_memory_dict[bucket_index] = torch.empty(total_ps_size, device=device, dtype=dtype)
        state.q_memory_dict[bucket_index] = torch.empty(total_qs_size, device=device, dtype=dtype)

    shape_to_tensors: defaultdict[torch.Size, list[Tensor]] = defaultdict(list)
    for matrix in to_compress:
        shape_to_tensors[matrix.shape].append(matrix)

    def batched() -> Iterator[Tensor]:
        for same_shape in shape_to_tensors.values():
            if state.batch_tensors_with_same_shape and len(same_shape) > 1:
                yield torch.stack(same_shape)
            else:
                for matrix in same_shape:
                    yield matrix.unsqueeze(0)

    batches: list[Tensor] = []
    ps: list[Tensor] = []
    qs: list[Tensor] = []
    p_idx = q_idx = 0
    for batch in batched():
        size, n, m = batch.shape
        rank = min(n, m, state.matrix_approximation_rank)
        batches.append(batch)
        ps.append(
            state.p_memory_dict[bucket_index][p_idx : p_idx + size * n * rank].view(size, n, rank)
        )
        qs.append(
            state.q_memory_dict[bucket_index][q_idx : q_idx + size * m * rank].view(size, m, rank)
        )
        p_idx += size * n * rank
        q_idx += size * m * rank

    if not need_randomize_qs:
        for q in qs:
            _orthogonalize(q, state.orthogonalization_epsilon)
    else:
        # The same seed on every rank; a different one every iteration.
        generator = _next_generator(state)
        for q in qs:
            q.copy_(torch.randn(*q.shape, generator=generator, device="cpu", dtype=dtype))
            _orthogonalize(q, state.orthogonalization_epsilon)

    for batch, q, p in zip(batches, qs, ps, strict=True):
        torch.bmm(batch, q, out=p)

    # The collectives, issued here in a fixed order: see Note [Collectives of a hook are
    # issued from the hook] in reducer.comm_hook.
    uncompressed_work = (
        group.allreduce([uncompressed_memory], ReduceOp.SUM)
        if uncompressed_memory.numel()
        else None
    )
    p_memory = state.p_memory_dict[bucket_index]
    group.allreduce([p_memory], ReduceOp.SUM).wait()  # the Ps are orthogonalized: not divided
    for p in ps:
        _orthogonalize(p, state.orthogonalization_epsilon)
    for batch, p, q in zip(batches, ps, qs, strict=True):
        torch.bmm(batch.transpose(1, 2), p, out=q)
    q_memory = state.q_memory_dict[bucket_index]
    pending = [future_of(group.allreduce([q_memory], ReduceOp.SUM))]
    if uncompressed_work is not None:
        pending.append(future_of(uncompressed_work))

    def decompress(_done: torch.futures.Future[list[torch.futures.Future[list[Tensor]]]]) -> Tensor:
        for future in _done.value():
            future.value()  # raises a collective's error
        if uncompressed:
            uncompressed_memory.div_(world_size)
            offset = 0
            for tensor in uncompressed:
                tensor.copy_(uncompressed_memory[offset : offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()
        q_memory.div_(world_size)
        for p, q, batch in zip(ps, qs, batches, strict=True):
            torch.bmm(p, q.transpose(1, 2), out=batch)
        if state.batch_tensors_with_same_shape:
            for batch in batches:
                if batch.shape[0] == 1:
                    continue  # a view of the buffer already
                for i, original in enumerate(shape_to_tensors[batch.shape[1:]]):
                    original.copy_(batch[i])
        for tensor, matrix in copied:
            tensor.copy_(matrix.view(tensor.shape))
        _synchronize(device)
        if input_tensor_cp is not None:
            state.error_dict[bucket_index] = input_tensor_cp - input_tensor
        if not state.warm_start:
            state.p_memory_dict.clear()
            state.q_memory_dict.clear()
        state.maybe_increase_iter(bucket)
        return input_tensor

    return torch.futures.collect_all(pending).then(decompress)


def batched_powerSGD_hook(state: PowerSGDState, bucket: GradBucket) -> torch.futures.Future[Tensor]:
    """PowerSGD on the whole bucket at once: the flat buffer, zero-padded to a square s x s,
    is reduced as one rank-r approximation (r capped at s). Faster than :func:`powerSGD_hook`,
    but the square mixes unrelated gradients, so it is far less accurate unless r is 1.

    The first ``state.start_powerSGD_iter`` iterations are a plain allreduce (the same bits as
    no hook); then as :func:`powerSGD_hook` with one matrix: P = M Q, allreduce, orthogonalize;
    Q = M^T P, allreduce, divide by W; M = P Q^T, truncated to the buffer's length.
    """
    group = state._group(bucket)
    world_size = group.size()
    input_tensor = bucket.buffer()
    if state.iter < state.start_powerSGD_iter or input_tensor.is_sparse:
        state.maybe_increase_iter(bucket)  # (warm-up, or a sparse gradient: as it is)
        return allreduce_divided(group, input_tensor)

    device, dtype = input_tensor.device, input_tensor.dtype
    total_length = input_tensor.shape[0]
    side = math.ceil(math.sqrt(total_length))
    rank = min(side, state.matrix_approximation_rank)
    state.total_numel_before_compression += total_length
    state.total_numel_after_compression += side * rank * 2
    # A padded copy: the bucket's own buffer keeps its size (its gradients are views of it).
    padded = torch.zeros(side * side, device=device, dtype=dtype)
    padded[:total_length].copy_(input_tensor)
    _report_compression_stats(bucket, state)

    bucket_index = bucket.index()
    padded_cp: Tensor | None = None
    if state.use_error_feedback:
        if bucket_index in state.error_dict:
            padded.add_(state.error_dict[bucket_index])
        else:
            state.error_dict[bucket_index] = torch.zeros(side * side, device=device, dtype=dtype)
        padded_cp = padded.detach().clone()
    matrix = padded.view(side, side)

    if not state.warm_start or bucket_index not in state.p_memory_dict:
        state.p_memory_dict[bucket_index] = torch.empty(side, rank, device=device, dtype=dtype)
        generator = _next_generator(state)
        state.q_memory_dict[bucket_index] = torch.randn(
            side, rank, generator=generator, device="cpu", dtype=dtype
        ).to(device)
    p_memory = state.p_memory_dict[bucket_index]
    q_memory = state.q_memory_dict[bucket_index]
    _orthogonalize(q_memory.unsqueeze(0))
    torch.matmul(matrix, q_memory, out=p_memory)

    # See Note [Collectives of a hook are issued from the hook] in reducer.comm_hook.
    group.allreduce([p_memory], ReduceOp.SUM).wait()
    _orthogonalize(p_memory.unsqueeze(0))
    torch.matmul(matrix.t(), p_memory, out=q_memory)
    q_future = future_of(group.allreduce([q_memory], ReduceOp.SUM))

    def decompress(done: torch.futures.Future[list[Tensor]]) -> Tensor:
        done.value()  # raises the collective's error
        q_memory.div_(world_size)
        torch.matmul(p_memory, q_memory.t(), out=matrix)
        if padded_cp is not None:
            state.error_dict[bucket_index] = padded_cp - padded
        _synchronize(device)
        if not state.warm_start:
            state.p_memory_dict.clear()
            state.q_memory_dict.clear()
        input_tensor.copy_(padded[:total_length])
        state.maybe_increase_iter(bucket)
        return input_tensor

    return q_future.then(decompress)
