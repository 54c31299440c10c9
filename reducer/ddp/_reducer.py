"""The reducer as ``DistributedDataParallel`` holds it: torch's reducer calls that tools read.

torch's DDP exposes its C++ reducer as ``ddp.reducer``, and its tests and tools call a few
of its methods: the used map of the last iteration, whether the set of unused parameters
has stayed the same, the removal of the autograd hooks, futures to await at the end of
backward (buffer comm hooks). :class:`DDPReducer` adds them to :class:`reducer.Reducer`
without changing what it reduces. The graph search runs inside a profiler range named as
torch names it (``search_unused_parameters``), so profiles read alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from reducer import errors
from reducer.buckets import Bucket
from reducer.comm_hook import FutureWork
from reducer.graph import gradient_accumulator, is_future, remove_hooks
from reducer.reducer import Reducer

__all__: list[str] = []


# A rank's view of a bucket, for skip_all_reduce_unused_params. See Note [Skipping buckets
# of unused parameters].
_NO_VIEW = -1  # a joined rank: it trains no more
_USED = 0  # some parameter of it is used in this synced pass
_ACCUMULATED = 1  # unused in this pass, but holds gradients accumulated under no_sync
_SKIP = 2  # unused, and nothing accumulated: this rank alone would skip it


class DDPReducer(Reducer):
    """A :class:`reducer.Reducer` with the calls torch's DDP reducer offers its callers, and
    torch's rules for gradients the reducer did not put there: a parameter found unused on
    this rank contributes the ``.grad`` it holds (see Note [Unused parameters] in
    reducer.reducer), and with ``gradient_as_bucket_view`` a ``.grad`` replaced by another
    tensor (a gradient accumulated by hand) is copied into its view at its next hook, as
    torch copies it, rather than refused."""

    _unused_contribute_held = True
    _adopt_replaced_grads = True

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._local_used: Tensor | None = None
        self._previous_unused: list[tuple[int, int]] | None = None
        self._graph_static = True
        self._post_backward_futures: list[torch.futures.Future[object]] = []
        self._runtime_logging_sample_rate = 100  # torch's kDDPRuntimeLoggingSampleRate
        # See _launch. Buckets reduced in the last iteration, and in the current one.
        self.skip_all_reduce_unused_params = False
        self.buckets_reduced = 0
        self._reducing = 0
        self._skipping: list[bool] = []  # per bucket, agreed by every rank this iteration

    def _check_prior_reduction_finished(self) -> None:
        """Raise torch's error, with this reducer's detail, where the previous iteration's
        reduction did not finish (some parameter got no gradient). torch checks this when
        an iteration starts and before it rebuilds buckets; so does the wrapper."""
        with self._lock:
            self._check_usable("prepare_for_backward")
            if not self._require_finalize:
                return
            missing = [i for i, ready in enumerate(self._ready[0]) if not ready]
            torch_text = ""
            if missing:
                torch_text = errors.torch_unfinished_text(
                    self._rank(),
                    missing,
                    self._names,
                    static=self._static.enabled,
                    searched=self._find_unused,
                )
            error = errors.unfinished_error(
                self._wording, self._rank(), self._ready, self._names, torch_text=torch_text
            )
            raise self._fail(error)

    def prepare_for_backward(self, outputs: Sequence[Tensor] = ()) -> None:
        self._check_prior_reduction_finished()
        if outputs:
            with torch.autograd.profiler.record_function("search_unused_parameters"):
                super().prepare_for_backward(outputs)
        else:
            super().prepare_for_backward(outputs)
        if self.skip_all_reduce_unused_params:
            self._skipping = self._agree_on_skips(self._local_skips())
        # torch's ddp_graph_static: false once the set of unused parameters has changed.
        unused = list(self._unused)
        if self._previous_unused is not None and unused != self._previous_unused:
            self._graph_static = False
        self._previous_unused = unused

    # Note [Skipping buckets of unused parameters]
    # With skip_all_reduce_unused_params, a bucket whose every parameter is unused in this
    # iteration (found by the search, or recorded by the static graph) and got no gradient
    # locally since the last synced step is not reduced: its contents (zeros) are its result,
    # what the allreduce of zeros would give. Like torch's, this needs the same buckets
    # skipped on every rank: where they differ, the ranks issue different collectives, and
    # torch's DDP sums one bucket of a rank with another bucket of another rank where their
    # shapes agree (two same-shaped branches, each unused on a different rank), silently.
    # So each synced iteration starts with one small allgather of every rank's view of each
    # bucket (one int per bucket: _USED, _ACCUMULATED or _SKIP), before any bucket is
    # reduced. A bucket is skipped only where every rank would skip it. Where some rank uses
    # it in this pass and another leaves it unused, every rank raises an error naming the
    # bucket's parameters and the ranks: the unused parameters differ, which the option
    # does not allow. Where it is unused everywhere in this pass but some ranks hold
    # gradients accumulated under no_sync, every rank reduces it (the others contribute
    # zeros): nothing a rank computed is lost. A rank that ran out of inputs under join has
    # no view of its own (_NO_VIEW): it takes the others' (see _shadow_iteration), so its
    # shadow reductions match theirs.

    def _local_skips(self) -> list[int]:
        """Per bucket, this rank's view (see the Note): _SKIP where every parameter is
        unused in this pass and got no gradient locally since the last synced pass,
        _ACCUMULATED where every one is unused but some got one under no_sync, else _USED."""
        views = []
        for bucket in self._buckets:
            indices = bucket.variable_indices
            if not all((0, i) in self._unused_set for i in indices):
                views.append(_USED)
            elif any(self._used[0][i] for i in indices):
                views.append(_ACCUMULATED)
            else:
                views.append(_SKIP)
        return views

    def _agree_on_skips(self, local: list[int] | None) -> list[bool]:
        """Every rank's view of each bucket (``local``; None: no view, a joined rank),
        gathered; per bucket, whether every rank skips it, or an error on every rank where
        some rank uses a bucket that another would skip."""
        count = len(self._buckets)
        device = self._replicas[0][0].device
        mine = torch.tensor([_NO_VIEW] * count if local is None else local, dtype=torch.int32)
        mine = mine.to(device)
        world = self._process_group.size()
        gathered = [torch.empty_like(mine) for _ in range(world)]
        self._process_group.allgather([gathered], [mine]).wait(self._timeout)
        table = [t.tolist() for t in gathered]
        agreed: list[bool] = []
        for index, bucket in enumerate(self._buckets):
            column = [row[index] for row in table]
            skipping = [r for r, v in enumerate(column) if v == _SKIP]
            reducing = [r for r, v in enumerate(column) if v == _USED]
            if skipping and reducing:
                names = ", ".join(
                    str(i) if self._names is None else f"{i} {self._names[i]!r}"
                    for i in bucket.variable_indices
                )
                raise self._fail(
                    errors.ReductionError(
                        "DistributedDataParallel(skip_all_reduce_unused_params=True) needs the "
                        "same parameters unused on every rank, but bucket "
                        f"{index} (parameters {names}) is unused on rank(s) {skipping} and "
                        f"used on rank(s) {reducing} in this pass: skipping it on some ranks "
                        "only would reduce different buckets together. Leave the same "
                        "parameters unused on every rank, or pass "
                        "skip_all_reduce_unused_params=False"
                    )
                )
            agreed.append(all(v in (_SKIP, _NO_VIEW) for v in column) and bool(skipping))
        return agreed

    def _shadow_iteration(self, *, used_map: bool) -> None:
        # A joined rank skips what the ranks still training skip. See the Note above.
        if self.skip_all_reduce_unused_params:
            self._skipping = self._agree_on_skips(None)
        super()._shadow_iteration(used_map=used_map)

    def _launch(self, bucket: Bucket) -> None:
        if bucket.index == 0:
            self._reducing = 0
        if (
            self.skip_all_reduce_unused_params
            and bucket.index < len(self._skipping)
            and self._skipping[bucket.index]
        ):
            bucket.work = _Kept([r.contents for r in bucket.replicas])
        else:
            self._reducing += 1
            super()._launch(bucket)
        if bucket.index == len(self._buckets) - 1:
            self.buckets_reduced = self._reducing

    def _launch_used_map(self) -> None:
        super()._launch_used_map()
        assert self._used_map is not None  # just launched
        self._local_used = self._used_map[1]  # allreduced in place: the global counts

    def _finalize_backward(self) -> None:
        super()._finalize_backward()
        futures, self._post_backward_futures = self._post_backward_futures, []
        for index, future in enumerate(futures):
            FutureWork(future, index, self._timeout, "buffer comm hook").wait()  # type: ignore[arg-type]

    def _refresh_accumulators(self) -> None:
        """Find each parameter's gradient accumulator again: autograd makes a new one when
        ``param.data`` changes dtype (mixed precision does, every forward), and the graph
        search must know the new ones."""
        with self._lock:
            self._accumulators = {
                gradient_accumulator(param): (r, i)
                for r, replica in enumerate(self._replicas)
                for i, param in enumerate(replica)
            }

    # torch's names ---------------------------------------------------------------------------

    def _get_local_used_map(self) -> Tensor:
        """Per parameter, on how many ranks it got a gradient in the last iteration that
        searched for unused parameters (int32, as torch's). Zeros before the first."""
        if self._local_used is None:
            return torch.zeros(len(self._replicas[0]), dtype=torch.int32)
        return self._local_used

    def _ddp_graph_static(self) -> bool:
        """Whether the set of unused parameters has been the same in every iteration."""
        return self._graph_static

    def _install_post_backward_futures(self, futures: Sequence[object]) -> None:
        """Futures (of a buffer comm hook) to await when this iteration's backward ends."""
        if is_future(futures) or not isinstance(futures, list | tuple):
            raise TypeError(
                "a buffer comm hook returns None or a list of torch.futures.Future (one per "
                f"collective it started), got {type(futures).__name__}; return [future] for "
                "a single one"
            )
        for future in futures:
            if not is_future(future):
                raise TypeError(
                    "a buffer comm hook returns None or a list of torch.futures.Future, got "
                    f"an element of type {type(future).__name__}"
                )
        self._post_backward_futures.extend(futures)

    def _remove_autograd_hooks(self) -> None:
        """Take this reducer's hooks off the parameters (torch's name): after an error in
        backward, so that a new wrapper can be built on the same module."""
        remove_hooks(self._hook_handles)

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        self._runtime_logging_sample_rate = int(sample_rate)


class _Kept:
    """A :class:`reducer.Work` that is already done: the bucket keeps its own contents."""

    def __init__(self, tensors: list[Tensor]) -> None:
        self._tensors = tensors

    def wait(self, timeout: float | None = None) -> None:
        return None

    def is_completed(self) -> bool:
        return True

    def result(self) -> list[Tensor]:
        return self._tensors


_WITH_BASE: dict[type[Reducer], type[DDPReducer]] = {}


def ddp_reducer_class(base: type[Reducer]) -> type[DDPReducer]:
    """:class:`DDPReducer` over ``base``: the wrapper builds its reducer from whatever class
    ``reducer.ddp.Reducer`` names when it builds it, so that a subclass put there (the
    property harness's mutants) is the one that reduces."""
    if base is Reducer:
        return DDPReducer
    if base not in _WITH_BASE:
        _WITH_BASE[base] = type(f"DDP{base.__name__}", (DDPReducer, base), {})
    return _WITH_BASE[base]
