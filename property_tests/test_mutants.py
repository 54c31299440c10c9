"""The properties catch every seeded bug, and Hypothesis shrinks each to a small example.

For each mutant of :data:`property_tests.mutants.CATALOGUE`, with the mutant in place of the
real code, Hypothesis searches the inputs of the property meant to catch it for one that
fails, and shrinks it. Each test asserts that one is found, that the shrunk example is small
(at most 3 parameters and 2 ranks, or 3 ranks for a rounding that differs only where W is not
a power of two, or 4 where the bug needs them: a 2 x 2 device mesh, three ranks still
training under join with one out; and where it says more, the smallest that can show the
bug: two ranks to see a wrong average, two replicas to see replica 1 left out, ...), and that
the real code passes that very example. A mutant of the scenarios themselves is killed by a
search (``SEARCHES``): within the ci profile's examples they must find a wrapper that is
wrong only at three ranks.

This is the fast check that CI runs: each search is narrowed to the part of the property's
input space where the mutant's bug lives (``CASES``), with the property's own check.
``benchmarks/harness_power.py`` runs the full measurement: the whole property suite, with
its own strategies and the ci profile's example counts, against each mutant.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test
from torch.nn.parallel.distributed import _MixedPrecision

import fakepg
import reducer
from reducer.testing import TrainingScenario, schedules
from reducer.testing.harness import Scenario, check_against_reference, reference, refusal
from reducer.testing.model import BranchSpec, ModelSpec, wide_width
from reducer.testing.scenario import SYNC_MODES
from reducer.testing.strategies import bucketing_inputs, model_specs, scenarios

from . import test_schedules
from .mutants import CATALOGUE, Mutant, applied
from .test_check_strictness import (
    check_division_is_found,
    check_one_ulp_is_caught,
    check_roundings_and_neighbours,
    rounding_cases,
    strictness_scenarios,
)
from .test_cluster_files import check_rate_spelling, rate_spellings
from .test_ddp_buckets import BucketScenario, bucket_scenarios, check_buckets
from .test_ddp_properties import DDPScenario, check_ddp, ddp_scenarios
from .test_errors import (
    check_invalid_buckets,
    check_unfinished_iteration,
    check_used_outside_forward,
    corrupted,
    unfinished_iterations,
    used_outside_forward,
)
from .test_launch_preimport import _PREFIX as _PROBE
from .test_launch_preimport import check_preimport, scripts
from .test_misuse import check_model_factory, model_factories
from .test_multi_iteration import TrainingMachine
from .test_replica_check import CheckScenario, check_replica_check, check_scenarios
from .test_stream_order import StreamScenario, check_stream_order, stream_scenarios
from .test_torch_comm_hooks import (
    MAGNITUDES,
    SCENARIOS,
    check_allreduce_hook,
    check_fp16_hook,
)
from .test_torch_equivalence import check_bucket_assignment
from .test_training_steps import (
    OUR_MICRO,
    check_hierarchical_averaging,
    check_micro_batches_ours,
    check_micro_batches_torch,
    hierarchical_cases,
    two_synced_micro_batches,
)
from .test_wrapper_options import (
    PARAMETERS,
    OptionScenario,
    check_options,
    check_refused,
    option_scenarios,
    refused_options,
)
from .test_wrappers import (
    _BUFFER_HOOKED,
    _STATIC,
    _UNEVEN_STATIC,
    MeshScenario,
    check_buffer_hook,
    check_device_mesh,
    check_fsdp2,
    check_fsdp2_shards,
    check_join_dividing_by_training_ranks,
    check_mixed_precision_dtypes,
    check_our_ddp,
    check_our_join,
    fsdp2_scenarios,
    fsdp2_shard_scenarios,
    mesh_scenarios,
    mixed_precision_configs,
    one_of_four_out,
    wrapper_scenarios,
)

# Generate, then shrink; no explain phase (it reruns variants of the shrunk example).
SEARCH = settings(
    max_examples=400,
    database=None,
    derandomize=True,
    deadline=None,
    phases=[Phase.generate, Phase.shrink],
    suppress_health_check=list(HealthCheck),
)
LATENCY_S = 0.05  # well past the end of a small model's backward


def _fails(check: Callable[[], None]) -> bool:
    """Does ``check`` fail? (``pytest.raises`` reports "did not raise" as pytest's own.)"""
    try:
        check()
    except (Exception, pytest.fail.Exception):
        return True
    return False


# -- what to search, and what counts as shrunk ---------------------------------------------------


@dataclass(frozen=True)
class Case:
    """Where a mutant's bug lives: inputs of ``check`` drawn from ``strategy``; ``minimal``
    says whether the shrunk example is the smallest that shows it."""

    strategy: st.SearchStrategy[Any]
    check: Callable[[Any], None]
    minimal: Callable[[Any], bool] = lambda _: True
    max_ranks: int = 2  # 3 where the bug shows only at a world size not a power of two


def _size(example: Any) -> tuple[int, int]:
    """(parameters, ranks) of an example of any property."""
    if isinstance(example, TrainingScenario):
        return len(list(example.make_model().parameters())), example.world_size
    if isinstance(example, Scenario | DDPScenario):
        return example.model.parameter_count, example.world_size
    if isinstance(example, tuple) and isinstance(example[0], TrainingScenario):  # local SGD
        return len(list(example[0].make_model().parameters())), example[0].world_size
    if isinstance(example, tuple) and isinstance(example[0], Scenario):  # (scenario, rank)
        return example[0].model.parameter_count, example[0].world_size
    if isinstance(example, _MixedPrecision):  # a configuration, checked on one Linear
        return 2, 1
    if isinstance(example, MeshScenario):  # always a 2 x 2 mesh
        return example.spec.parameter_count, 4
    if isinstance(example, tuple) and isinstance(example[0], str):  # a script: no ranks
        return 0, 1
    if isinstance(example, OptionScenario):
        return PARAMETERS, example.world_size
    if isinstance(example, dict):  # arguments for one wrapper's construction: one rank
        return 0, 1
    if isinstance(example, CheckScenario):  # a Linear layer or two, a frozen one, a head
        return example.parameters, example.world_size
    if isinstance(example, BucketScenario):
        return example.parameter_count, example.world_size
    if isinstance(example, StreamScenario):  # collectives of one small tensor: no model
        return 0, example.world_size
    return len(example[0]), 1  # bucketing inputs: tensors, limits, flags


def _one_step(s: Scenario, *, ranks: int | None = None, replicas: int | None = None) -> bool:
    return (
        len(s.steps) == 1
        and (ranks is None or s.world_size == ranks)
        and (replicas is None or s.replicas == replicas)
    )


def _plain(**overrides: Any) -> dict[str, Any]:
    """Scenario flags that switch off what the bug does not need (a faster search)."""
    flags: dict[str, Any] = {
        "static_graph": False,
        "hook": "none",
        "backward": "plain",
        "twice": False,
        "rebuild": False,
        "latency": 0.0,
    }
    flags.update(overrides)
    return flags


with_optional = model_specs(require_optional=True)
dense_optional = model_specs(require_optional=True, allow_sparse=False)
dense_all_used = model_specs(allow_unused=False, allow_sparse=False)
checkpointed = model_specs(allow_unused=False, allow_sparse=False, allow_checkpoint=True)
sparse_optional = st.builds(
    lambda seed: ModelSpec(
        (BranchSpec("proj"), BranchSpec("embedding", sparse=True, optional=True)), seed=seed
    ),
    st.integers(0, 2**16),
)
sparse_only = st.builds(
    lambda seed: ModelSpec((BranchSpec("embedding", sparse=True),), seed=seed),
    st.integers(0, 2**16),
)
wide_only = st.builds(
    lambda out, seed: ModelSpec((BranchSpec("proj", width=wide_width(out), out=out),), seed=seed),
    st.integers(1, 4),
    st.integers(0, 2**16),
)

averaging = check_against_reference


def _two_ranks_micro_batches(
    *, buffers: bool, require_optional: bool = False
) -> st.SearchStrategy[TrainingScenario]:
    """Up to two ranks, plain layers, up to three micro-batches a step in any sync pattern,
    each unsynced one in any of the modes (``no_sync()``, the attribute, by hand)."""
    return wrapper_scenarios(
        buffers=buffers,
        layouts=False,
        as_view=False,
        dropout=False,
        ignore=False,
        require_optional=require_optional,
        micro_batches=3,
        max_world_size=2,
        sync_modes=SYNC_MODES[1:],
    )


CASES: dict[str, Case] = {
    # One branch, two ranks of one replica: the smallest world where the sum is not the average.
    "skip the divide": Case(
        scenarios(unused=False, **_plain()),
        averaging,
        lambda s: _one_step(s, ranks=2, replicas=1) and len(s.model.branches) == 1,
    ),
    # One rank of two replicas: divided by two where the sum over one rank is the average.
    "divide by world size x replicas": Case(
        scenarios(unused=False, max_world_size=2, **_plain()),
        averaging,
        lambda s: _one_step(s, ranks=1, replicas=2),
    ),
    # A weight above the size where the division is fused into the copy, on two ranks.
    "divide large gradients twice": Case(
        scenarios(unused=False, model=wide_only, max_replicas=1, as_view=False, **_plain()),
        averaging,
        lambda s: _one_step(s, ranks=2),
    ),
    # One rank is enough: the layout is wrong before any communication.
    "off-by-one bucket offset": Case(
        scenarios(unused=False, **_plain()),
        averaging,
        lambda s: _one_step(s, ranks=1, replicas=1) and max(len(b) for b in s.buckets) >= 2,
    ),
    # Two ranks whose buckets become ready in different orders: one needs an unused branch.
    "launch out of order": Case(
        scenarios(find_unused=True, model=with_optional, max_world_size=4, **_plain()),
        averaging,
        lambda s: _one_step(s, ranks=2, replicas=1) and len(s.buckets) >= 2,
    ),
    # A second synced iteration: the wrapper's property runs several.
    "launch pointer not reset": Case(
        ddp_scenarios(min_iterations=2, mode="plain", hook="none"),
        check_ddp,
        lambda s: s.world_size == 1,
    ),
    # Two contributions, and a network slower than the backward of a small model.
    "forget to wait": Case(
        scenarios(
            unused=False,
            find_unused=False,
            max_world_size=2,
            max_replicas=2,
            model=model_specs(max_branches=2, max_params=4, allow_unused=False),
            **_plain(latency=LATENCY_S),
        ),
        averaging,
        lambda s: _one_step(s) and s.world_size * s.replicas == 2,
    ),
    "drop the last bucket": Case(
        scenarios(unused=False, **_plain()),
        averaging,
        lambda s: _one_step(s) and s.world_size * s.replicas == 2,
    ),
    # One rank with two replicas.
    "reduce only replica 0": Case(
        scenarios(unused=False, **_plain()),
        averaging,
        lambda s: _one_step(s, ranks=1, replicas=2),
    ),
    "replicas read replica 0": Case(
        scenarios(unused=False, as_view=False, **_plain()),
        averaging,
        lambda s: _one_step(s, ranks=1, replicas=2),
    ),
    "write back replica 0 only": Case(
        scenarios(unused=False, as_view=False, **_plain()),
        averaging,
        lambda s: _one_step(s, ranks=1, replicas=2),
    ),
    # One rank that skips an optional branch.
    "globally unused as zero": Case(
        scenarios(find_unused=True, model=with_optional, **_plain()),
        averaging,
        lambda s: _one_step(s, ranks=1, replicas=1) and any(e.untouched for e in reference(s)),
    ),
    # One rank: every parameter the synced backward uses looks unused.
    "used map taken at prepare": Case(
        scenarios(find_unused=True, **_plain()),
        averaging,
        lambda s: _one_step(s, ranks=1),
    ),
    # Two ranks, one of which skips a branch the other runs.
    "used map reduced with MIN": Case(
        scenarios(find_unused=True, model=with_optional, **_plain()),
        averaging,
        lambda s: _one_step(s, ranks=2),
    ),
    # Two ranks, one of which skips a branch whose parameters hold an older gradient.
    "locally unused contributes stale grad": Case(
        scenarios(find_unused=True, model=with_optional, preset_grads=True, **_plain()),
        averaging,
        lambda s: _one_step(s, ranks=2),
    ),
    # One local step, then the synced one, and two contributions: with one, the lost
    # gradient is still in .grad, and the parameter, unused everywhere, keeps it.
    "lose accumulated gradients": Case(
        scenarios(
            find_unused=True, model=with_optional, min_local_steps=1, max_local_steps=2, **_plain()
        ),
        averaging,
        lambda s: len(s.steps) == 2 and s.world_size * s.replicas == 2,
    ),
    # Bucket views: two contributions (the stale view of one is summed into the bucket,
    # which is .grad), or one rank that skips a branch no other rank runs.
    "bucket view contributes stale grad": Case(
        scenarios(
            find_unused=True, model=with_optional, preset_grads=True, as_view=True, **_plain()
        ),
        averaging,
        lambda s: _one_step(s) and s.world_size * s.replicas == 2,
    ),
    # Buckets are rebuilt after the first iteration, by the wrapper. A .grad left in the old
    # bucket is copied into its new view at its hook, as torch's DDP copies a .grad that is
    # not its view: multiplied by 1 / W where autograd's accumulation into the view is
    # divided, so three ranks show it.
    "rebuilt buckets keep old views": Case(
        ddp_scenarios(min_iterations=2, mode="plain", as_view=True, hook="none"),
        check_ddp,
        lambda s: s.world_size == 3,
        max_ranks=3,
    ),
    "sparse gradient not divided": Case(
        scenarios(unused=False, model=sparse_only, **_plain()),
        averaging,
        lambda s: _one_step(s, ranks=2),
    ),
    # Two ranks, one of which skips the table it holds an older sparse gradient of.
    "skipped sparse table contributes stale grad": Case(
        scenarios(find_unused=True, model=sparse_optional, preset_sparse=True, **_plain()),
        averaging,
        lambda s: _one_step(s, ranks=2),
    ),
    "prescale with a comm hook too": Case(
        scenarios(unused=False, model=dense_all_used, max_replicas=1, **_plain(hook="allreduce")),
        averaging,
        lambda s: _one_step(s, ranks=2),
    ),
    # Two ranks: on one, the half-precision sum is the rounded full-precision one.
    "compression after the reduction": Case(
        scenarios(
            unused=False, model=dense_all_used, max_replicas=1, **_plain(hook="fp16 wrapper")
        ),
        averaging,
        lambda s: _one_step(s, ranks=2),
    ),
    # torch's hooks on torch's DDP: two ranks (on one, the sum is the average, and a sum of
    # one term is not rounded).
    "torch allreduce hook not divided": Case(
        SCENARIOS, check_allreduce_hook, lambda s: s.world_size == 2
    ),
    "torch fp16 hook sums in float32": Case(
        SCENARIOS, check_fp16_hook, lambda s: s.world_size == 2
    ),
    # Two ranks whose float16 shares each fit, but not their sum: only drawn magnitudes show
    # it (at two ranks, dividing before or after the sum is otherwise the same bits).
    # One step of two micro-batches, the first with the attribute toggled by hand: reduced
    # early, the average is the same sum in another order, so only its rounding shows it
    # (surely at three ranks, where dividing by W rounds).
    "only no_sync accumulates": Case(OUR_MICRO, check_micro_batches_ours, max_ranks=3),
    # Two ranks, two synced micro-batches in a step, one rank leaving a branch out of the
    # second: it must contribute the first average its .grad holds. (Shrinks to one step or
    # two.)
    "held gradient of an unused parameter dropped": Case(
        _two_ranks_micro_batches(buffers=False, require_optional=True),
        check_micro_batches_ours,
        lambda s: s.world_size == 2 and any(s.syncs(k).count("sync") >= 2 for k in range(s.steps)),
    ),
    # Three ranks (at two, averaging an average again gives it back exactly), two synced
    # micro-batches, a head no rank runs in the second: torch's DDP leaves it as it was.
    "reference averages an untouched .grad again": Case(
        two_synced_micro_batches(),
        check_micro_batches_torch,
        lambda s: s.world_size == 3,
        max_ranks=3,
    ),
    # Two ranks with buffers, a no_sync() micro-batch, then a synced one: it must start from
    # each rank's own buffers.
    "buffers synced at every forward": Case(
        _two_ranks_micro_batches(buffers=True),
        check_micro_batches_ours,
        lambda s: s.world_size == 2,
    ),
    # One rank is enough: a by-hand micro-batch's gradient missing from the step's sum.
    "by-hand accumulation forgets the unsynced micro-batch": Case(
        OUR_MICRO,
        check_micro_batches_ours,
        lambda s: s.world_size == 1 and "by_hand" in s.syncs(0),
    ),
    # At three ranks dividing before or after the sum rounds differently whatever the data;
    # at two, only a drawn magnitude shows it (float16 shares that fit, a sum that does not:
    # tests/corpus/test_fp16_compress_hook.py searches two ranks only).
    "torch fp16 hook divides after the sum": Case(MAGNITUDES, check_fp16_hook, max_ranks=3),
    # One rank is enough: the .grad of a transposed weight, a view of its bucket.
    "bucket views ignore strides": Case(
        wrapper_scenarios(buffers=False, layouts=True, as_view=True), check_our_ddp
    ),
    # Two ranks, uneven: the one still training skips a branch after the other ran out.
    "joined rank's used map says all used": Case(
        wrapper_scenarios(
            buffers=False,
            layouts=False,
            as_view=False,
            dropout=False,
            ignore=False,
            uneven=True,
            max_world_size=2,
        ),
        check_our_join,
        lambda s: s.world_size == 2,
    ),
    # Two ranks: an ignored parameter's gradient is averaged.
    "ignored parameters reduced": Case(
        wrapper_scenarios(buffers=False, layouts=False, as_view=False),
        check_our_ddp,
        lambda s: s.world_size == 2,
    ),
    # The data-parallel dimension second: the ranks the whole mesh's first dimension groups.
    "device mesh slice taken as the whole mesh's first dimension": Case(
        mesh_scenarios(), check_device_mesh, lambda s: s.dp_dim == 1, max_ranks=4
    ),
    # Two ranks, two steps, a buffer comm hook: it broadcasts the buffer forward replaced.
    "buffer comm hook gets reassigned buffers stale": Case(
        _BUFFER_HOOKED, check_buffer_hook, lambda s: s.world_size == 2
    ),
    # Two ranks, two steps: the second forward starts from rank 0's reassigned buffer.
    "reassigned buffer not synced": Case(
        wrapper_scenarios(buffers=True), check_our_ddp, lambda s: s.world_size == 2
    ),
    # Two ranks with dropout: one rank's seed reseeds the other's stream.
    "one random stream for all ranks": Case(
        wrapper_scenarios(buffers=False, layouts=False, as_view=False, dropout=True),
        check_our_ddp,
        lambda s: s.world_size == 2,
    ),
    # Three ranks, a parameter of 4 rows (sharded 2, 2, 0 by FSDP2): the reference's shards
    # have other shapes. One step shows it.
    "FSDP2 reference shards rows evenly": Case(
        fsdp2_shard_scenarios(st.just(3), max_steps=1),
        check_fsdp2_shards,
        lambda s: s.world_size == 3,
        max_ranks=3,
    ),
    # FSDP2 on two ranks: each gets the other's shard of the gradient.
    "reduce_scatter chunks reversed": Case(
        fsdp2_scenarios(), check_fsdp2, lambda s: s.world_size == 2
    ),
    # A layer in two reentrant checkpoints: the refusal is expected, even on one rank.
    "finalize at a checkpoint's inner end": Case(
        scenarios(unused=False, model=checkpointed, max_world_size=2, **_plain()),
        averaging,
        lambda s: _one_step(s, ranks=1) and refusal(s) is not None,
    ),
    # backward(create_graph=True) or a gradient penalty, two ranks (a division to record).
    "hooks recorded under grad mode": Case(
        scenarios(unused=False, model=dense_all_used, **_plain(backward=None)),
        averaging,
        lambda s: _one_step(s) and s.backward != "plain",
    ),
    # A second backward, or a layer in two reentrant checkpoints: the refusal is expected.
    "second backward accepted silently": Case(
        scenarios(unused=False, model=checkpointed, **_plain(twice=None)),
        averaging,
        lambda s: _one_step(s, ranks=1) and refusal(s) is not None,
    ),
    "static graph forgets unused": Case(
        ddp_scenarios(model=dense_optional, min_iterations=2, mode="static_graph", hook="none"),
        check_ddp,
    ),
    "static graph ready at first call": Case(
        ddp_scenarios(model=checkpointed, min_iterations=2, mode="static_graph", hook="none"),
        check_ddp,
        lambda s: s.world_size == 1,
    ),
    "left-out heads count as used": Case(
        ddp_scenarios(model=dense_optional, hook="none"),
        check_ddp,
        lambda s: s.world_size == 1,
    ),
    "nested outputs not searched": Case(
        ddp_scenarios(model=dense_optional, mode="find_unused", hook="none", nested=True),
        check_ddp,
        lambda s: s.world_size == 1,
    ),
    # Either one rank leaves out a head whose output is in a dict (the sink never sees it:
    # the iteration cannot finish), or two ranks whose gradients from outputs in dicts count
    # as none (on one rank, its own gradient is the average).
    "dict outputs bypass the sink": Case(
        ddp_scenarios(model=dense_optional, hook="none", nested=True), check_ddp
    ),
    # A local pass that the mutant reduces: on one rank, reducing changes nothing.
    # DDP at a world size that is not a power of two (where g / W and g * (1 / W) differ).
    "DDP divides instead of multiplying": Case(
        ddp_scenarios(model=dense_all_used, mode="plain", hook="none"),
        check_ddp,
        lambda s: s.world_size == 3,
        max_ranks=3,
    ),
    # A weight of 2**16 elements or more (its division fused into the copy) at 3 ranks.
    "fused copy divides": Case(
        ddp_scenarios(model=wide_only, mode="plain", hook="none", as_view=False),
        check_ddp,
        lambda s: s.world_size == 3,
        max_ranks=3,
    ),
    # Four ranks, one out: the divisor is three (needs a fourth rank to be other than W).
    "join divisor divides": Case(
        one_of_four_out(),
        check_join_dividing_by_training_ranks,
        lambda s: s.world_size == 4,
        max_ranks=4,
    ),
    # A gradient autograd accumulated into its bucket view in place, at 3 ranks: torch divides it.
    "views always multiply": Case(
        ddp_scenarios(model=dense_all_used, mode="plain", hook="none", as_view=True),
        check_ddp,
        lambda s: s.world_size == 3,
        max_ranks=3,
    ),
    # DDP's first backward copies each fresh gradient into its bucket view, multiplied.
    "views scaled twice": Case(
        ddp_scenarios(model=dense_all_used, mode="plain", hook="none", as_view=True),
        check_ddp,
        lambda s: s.world_size == 2,
    ),
    "no_sync ignored": Case(
        ddp_scenarios(model=dense_all_used, mode="plain", hook="none"),
        check_ddp,
        lambda s: s.world_size == 2,
    ),
    # Ranks whose gradients become ready in different orders (static graph, one of them
    # skipping a branch), so that their own orders give different buckets.
    "rebuild from own ready order": Case(
        ddp_scenarios(model=dense_optional, min_iterations=2, mode="static_graph", hook="none"),
        check_ddp,
        lambda s: s.world_size == 2,
    ),
    # Two parameters, one rank: torch reduces them in one bucket first, the mutant in two.
    "first iteration bucketed by cap": Case(
        bucket_scenarios(find_unused=False, static=(None,)),
        check_buckets,
        lambda s: s.parameter_count == 2 and s.world_size == 1,
    ),
    # Two dtypes: a float64 bucket that closes after a float32 bucket left open, or a sparse
    # parameter's bucket, come out ahead of the open one; sorted, they would not.
    "rebuilt buckets sorted": Case(
        bucket_scenarios(find_unused=False, static=(None,)),
        check_buckets,
        lambda s: s.parameter_count <= 3 and s.world_size == 1,
    ),
    # Two ranks, a static graph, one runs out: its shadow issues a used map the other does not.
    "joined rank shadows a static graph's used map": Case(
        _UNEVEN_STATIC, check_our_join, lambda s: s.world_size == 2 and s.uneven
    ),
    # Two ranks, one ignored parameter, reloaded between two steps: the reloaded wrapper
    # averages the ignored parameter's gradient (each rank keeps its own before).
    "reloaded wrapper reduces ignored parameters": Case(
        wrapper_scenarios(buffers=False, layouts=False, as_view=False, dropout=False, reload=True),
        check_our_ddp,
        lambda s: s.world_size == 2 and s.reload_after is not None and len(s.ignored) == 1,
    ),
    # A static graph, reloaded, then steps that leave a branch out: the wait for its
    # gradient shows as an unfinished reduction at the next step (or on two ranks, as the
    # others' reductions moving on without it).
    "reloaded static graph not told to the reducer": Case(
        _STATIC, check_our_ddp, lambda s: s.reload_after is not None
    ),
    # Two ranks, one bucket of a used and an unused parameter (the same unused everywhere):
    # the used one keeps its own gradient.
    "skip a bucket partly unused": Case(
        wrapper_scenarios(
            buffers=False, layouts=False, as_view=False, dropout=False, skip_unused=True
        ),
        check_our_ddp,
        lambda s: s.world_size == 2 and s.options["skip_all_reduce_unused_params"],
    ),
    # skip_all_reduce_unused_params, a no_sync pass that runs a branch the synced pass then
    # leaves unused on every rank (the accumulated gradient must still be averaged).
    "skip forgets no_sync gradients": Case(
        ddp_scenarios(model=dense_optional, mode="find_unused", hook="none", skip_unused=True),
        check_ddp,
        lambda s: s.world_size <= 2,
    ),
    # Two ranks, reducing in float16 or bfloat16: the sum rounded once, not per addition.
    "mixed precision sums in full precision": Case(
        wrapper_scenarios(
            buffers=False, layouts=False, as_view=False, dropout=False, mixed=True, lr=0.0
        ),
        check_our_ddp,
        lambda s: s.world_size == 2 and s.options["mixed_precision"] is not None,
    ),
    # Three ranks, reducing in float16 or bfloat16: (sum / 3) in the low dtype differs from
    # the sum cast back and divided in full precision.
    "mixed precision divides after the upcast": Case(
        wrapper_scenarios(
            buffers=False, layouts=False, as_view=False, dropout=False, mixed=True, lr=0.0
        ),
        check_our_ddp,
        lambda s: s.world_size == 3 and s.options["mixed_precision"] is not None,
        max_ranks=3,
    ),
    "mixed precision buffers in param_dtype": Case(
        mixed_precision_configs(),
        check_mixed_precision_dtypes,
        lambda c: c.param_dtype != c.buffer_dtype,
    ),
    # os.environ set, then an import: it must wait for the ranks.
    "launch pre-imports past the leading block": Case(
        scripts(),
        check_preimport,
        lambda script: "os.environ" in script[0] and script[0].count(_PROBE) == 1,
    ),
    # Two ranks, a one-ulp fault on one of them.
    "replica check compares with a tolerance": Case(
        check_scenarios(),
        check_replica_check,
        lambda s: s.world_size == 2 and s.fault is not None,
    ),
    # Two ranks, two parameter groups, the fault in the second (a bias).
    "replica check reads the first param group only": Case(
        check_scenarios(),
        check_replica_check,
        lambda s: s.world_size == 2 and s.groups == 2 and s.fault is not None,
    ),
    # Two ranks under join, one with a step more: its last step is taken for a stall.
    "replica check blind to join": Case(
        check_scenarios(),
        check_replica_check,
        lambda s: s.world_size == 2 and s.joined is not None,
    ),
    # Two ranks, a frozen layer (none loads it: two parameters compared, not three; or one
    # rank loads it: in sync, not diverged at the frozen weight).
    "replica check skips frozen parameters": Case(
        check_scenarios(("frozen",)),
        check_replica_check,
        lambda s: s.world_size == 2 and s.fault is None and len(s.loaded) <= 1,
    ),
    # Two ranks, ZeRO over two equal blocks, no fault: each rank's inner optimizer holds
    # the other block.
    "replica check compares ZeRO shards by position": Case(
        check_scenarios(("zero",)),
        check_replica_check,
        lambda s: s.world_size == 2 and s.fault is None,
    ),
    # Two ranks, an ignored parameter that differs per rank, no fault elsewhere.
    "replica check compares ignored parameters": Case(
        check_scenarios(("ignored",)),
        check_replica_check,
        lambda s: s.world_size == 2 and s.fault in (None, (0, 2), (1, 2)),
    ),
    # Two ranks, one backward after two forwards (a siamese pair), or two backwards after
    # one forward and two.
    "replica check counts forwards as micro-steps": Case(
        check_scenarios(("siamese",)),
        check_replica_check,
        lambda s: s.world_size == 2 and s.fault is None and sum(s.micro) == 2 + (len(s.micro) > 1),
    ),
    # Two ranks, a one-ulp fault on one: the other's gradient is the average of the ranks' own.
    "replica check blames a summed bucket it cannot prove": Case(
        check_scenarios(),
        check_replica_check,
        lambda s: s.world_size == 2 and s.feature == "plain" and s.fault is not None,
    ),
    # Two ranks of torch's DDP skipping unused buckets, each running its own head.
    "replica check blames a summed bucket on a generic cause": Case(
        check_scenarios(("summed",)),
        check_replica_check,
        lambda s: s.world_size == 2 and s.kind == "torch" and s.skip and s.heads == (0, 1),
    ),
    # Two ranks whose models start different, init_sync on: torch's start from rank 0's.
    "construction never syncs": Case(
        option_scenarios("init_sync"),
        check_options,
        lambda s: s.world_size == 2 and s.per_rank_init and s.init_sync,
    ),
    # Two ranks whose buffers start different, init_sync on, forward_sync_buffers=False.
    "forward_sync_buffers taken for broadcast_buffers": Case(
        option_scenarios("buffers"),
        check_options,
        lambda s: (
            s.world_size == 2
            and s.per_rank_init
            and s.init_sync
            and s.buffers == ("forward_sync_buffers", False)
        ),
    ),
    # One rank is enough: the buckets the wrapper is built with (searching for unused
    # parameters: see Note [The first iteration's buckets]).
    "bucket_cap_mb_list taken as its largest cap": Case(
        option_scenarios("caps"),
        check_options,
        lambda s: s.world_size == 1 and s.caps is not None and s.caps[0] == "bucket_cap_mb_list",
    ),
    # One rank is enough: float16's rounding of its own gradient.
    "built-in FP16_COMPRESS registered as ALLREDUCE": Case(
        option_scenarios("hook"),
        check_options,
        lambda s: s.world_size == 1 and s.hook == "FP16_COMPRESS",
    ),
    # One rank is enough: the head no rank uses is waited for (static_graph=True calls it).
    "_set_static_graph not told to the reducer": Case(
        option_scenarios("static"),
        check_options,
        lambda s: s.world_size == 1 and s.static is not None,
    ),
    "refused arguments accepted silently": Case(refused_options(), check_refused),
    # One factory: the smallest misuse that shows it.
    "model factory not checked for determinism": Case(
        model_factories(), check_model_factory, lambda case: case["ranks"] == 1
    ),
    "cluster file units read case-blind": Case(rate_spellings(), check_rate_spelling),
    # One rank is enough: the gradient one ulp off the exact one passes a tolerance.
    "check compares with a tolerance": Case(
        strictness_scenarios(), check_one_ulp_is_caught, lambda s: s.world_size == 1
    ),
    # One rank is enough: every rounding is its gradient, and its neighbour is none.
    "check takes a value one ulp from a rounding for it": Case(
        rounding_cases(), check_roundings_and_neighbours, lambda c: c[0].world_size == 1
    ),
    # Two ranks, groups of one and of two: step 0 is divided by both periods.
    "hierarchical averaging picks the smallest period": Case(
        hierarchical_cases(), check_hierarchical_averaging, lambda c: c[0].world_size == 2
    ),
    # Two ranks, the first's input written on a stream the side stream never waits for.
    "stream order waits for the last launching rank only": Case(
        stream_scenarios(), check_stream_order, lambda s: s.world_size == 2
    ),
    # Two ranks, uneven steps without join().
    "replica check reads join from a truthy configuration": Case(
        check_scenarios(("plain",)),
        check_replica_check,
        lambda s: s.world_size == 2 and not s.join,
    ),
    "hooks left after close": Case(
        scenarios(unused=False, **_plain()),
        averaging,
        lambda s: _one_step(s, ranks=1, replicas=1),
    ),
}

# Properties whose inputs are not a Scenario: the training machine, misuse, bucketing.
TRAINING = {"stale locally-used map"}
MISUSE: dict[str, list[tuple[st.SearchStrategy[Any], Callable[..., None]]]] = {
    "vague errors": [
        (used_outside_forward(), check_used_outside_forward),
        (unfinished_iterations(), check_unfinished_iteration),
    ],
    "accept invalid buckets": [(corrupted(), check_invalid_buckets)],
}
# The scheduler's mutants: each lets a race of property_tests/test_schedules.py through (no
# schedule shows it), so the race property fails.
SCHEDULING = {"schedule choices ignored", "completions at once"}
# The exploration's mutants: each fails a property of property_tests/test_schedules.py run
# as it is, on its shrunk example where it has one (two ranks; torch's DDP at one rank with
# two parameters), and the real code passes it.
EXPLORATION: dict[str, Callable[[], None]] = {
    "completions oldest first": test_schedules.every_completion_order_is_drawn,
    "replay drops the completion policy": lambda: _replay_fails("two in flight"),
    "C++ backward wait not seen as blocked": lambda: test_schedules.ddp_averages_under_schedule(
        1, fakepg.Schedule()
    ),
    "PCT change points only early": test_schedules.change_points_reach_the_end,
}


def _replay_fails(name: str) -> None:
    """The replay property over drawn schedules (the late policy among them)."""

    @given(schedule=schedules())
    @settings(max_examples=50, database=None, deadline=None, derandomize=True)
    def replays(schedule: fakepg.Schedule) -> None:
        test_schedules.replay_is_the_run(name, schedule)

    replays()


# A mutant of the scenarios: the property that kills it is a search, not a check of one
# example (it must find, within the ci profile's examples, a wrapper wrong only at W = 3).
SEARCHES: dict[str, Callable[[], object]] = {
    "scenarios never draw three ranks": check_division_is_found,
}
BUCKETING = {
    "never move to the next limit",
    "one limit for all keys",
    "sparse gradients not alone",
    "buckets unsorted",
}


def test_every_slow_case_is_a_case() -> None:
    assert not SLOW_CASES - set(CASES), sorted(SLOW_CASES - set(CASES))


def test_every_mutant_has_a_case() -> None:
    assert set(CASES) | TRAINING | set(MISUSE) | BUCKETING | SCHEDULING | set(SEARCHES) | set(
        EXPLORATION
    ) == set(CATALOGUE)
    assert len(CATALOGUE) >= 25


@pytest.mark.parametrize("name", sorted(SCHEDULING))
def test_the_race_property_kills_the_scheduler_mutants(name: str) -> None:
    races = sorted(test_schedules.RACY)
    with applied(CATALOGUE[name]):
        missed = [
            r for r in races if _fails(lambda r=r: test_schedules.race_is_found_and_shrunk(r))
        ]
    assert missed, f"{name}: every race is still found"
    for race in missed:
        test_schedules.race_is_found_and_shrunk(race)  # the real scheduler shows it


@pytest.mark.parametrize("name", sorted(EXPLORATION))
def test_the_exploration_properties_kill_their_mutants(name: str) -> None:
    with applied(CATALOGUE[name]):
        assert _fails(EXPLORATION[name]), f"{name}: the property still holds"
    EXPLORATION[name]()  # the real code passes it


def _search(mutant: Mutant, strategy: st.SearchStrategy[Any], check: Callable[[Any], None]) -> Any:
    """The shrunk example on which ``check`` fails with ``mutant`` in place."""
    with applied(mutant):
        return find(strategy, lambda example: _fails(lambda: check(example)), settings=SEARCH)


# The mutants whose search takes more than a second or two on two cores (measured with
# --durations): the full run catches them, the quick run (-m "not slow") leaves them out.
SLOW_CASES = frozenset(
    {
        "bucket view contributes stale grad",
        "held gradient of an unused parameter dropped",
        "ignored parameters reduced",
        "launch out of order",
        "left-out heads count as used",
        "locally unused contributes stale grad",
        "rebuild from own ready order",
        "reloaded wrapper reduces ignored parameters",
        "replica check blind to join",
        "skip a bucket partly unused",
        "skip forgets no_sync gradients",
        "skipped sparse table contributes stale grad",
        "static graph ready at first call",
        "used map reduced with MIN",
    }
)


def _cases() -> list[Any]:
    """The names of CASES, the slow ones marked."""
    return [
        pytest.param(name, marks=pytest.mark.slow) if name in SLOW_CASES else name
        for name in sorted(CASES)
    ]


@pytest.mark.parametrize("name", _cases())
def test_the_properties_catch_and_shrink(name: str) -> None:
    case = CASES[name]
    shrunk = _search(CATALOGUE[name], case.strategy, case.check)
    parameters, ranks = _size(shrunk)
    assert parameters <= 3 and ranks <= case.max_ranks, f"{name}: not shrunk: {shrunk}"
    assert case.minimal(shrunk), f"{name}: not shrunk to the smallest case: {shrunk}"
    case.check(shrunk)  # the real code passes the very example that exposes the mutant


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TRAINING))
def test_the_training_property_catches_and_shrinks(name: str) -> None:
    # The same machine over a smaller space, where the bug shows (unused parameters are
    # searched for): every run replays a world and three sets of models, and shrinking
    # replays hundreds of runs.
    machine: Any = type(
        "BrokenTrainingMachine",
        (TrainingMachine,),
        {
            "last_run": [],
            "model_space": model_specs(max_branches=2, max_params=4, require_optional=True),
            "max_world_size": 2,
            "max_replicas": 1,
            "find_unused_choices": (True,),
        },
    )
    with applied(CATALOGUE[name]), pytest.raises(AssertionError):
        run_state_machine_as_test(
            machine, settings=settings(SEARCH, max_examples=1000, stateful_step_count=5)
        )
    # Shrunk to: set up one rank, a synced backward, an optimizer step, a synced backward.
    assert len(machine.last_run) <= 4, f"{name}: not shrunk: {machine.last_run}"
    assert machine.last_run[0] == "setup(world_size=1, replicas=1)", machine.last_run


@pytest.mark.parametrize("name", sorted(BUCKETING))
def test_the_bucketing_property_catches_and_shrinks(name: str) -> None:
    tensors, limits, sparse = _search(
        CATALOGUE[name], bucketing_inputs(), lambda case: check_bucket_assignment(*case)
    )
    # Two tensors show each bug, but "the next limit" needs a third to follow a second limit.
    assert len(tensors) <= 3 and len(limits) <= 2, f"{name}: not shrunk: {len(tensors)} tensors"
    check_bucket_assignment(tensors, limits, sparse)


@pytest.mark.parametrize(
    ("name", "strategy", "check"),
    [(name, strategy, check) for name, cases in MISUSE.items() for strategy, check in cases],
    ids=[f"{name}-{check.__name__}" for name, cases in MISUSE.items() for _, check in cases],
)
def test_the_misuse_properties_catch_and_shrink(
    name: str, strategy: st.SearchStrategy[Any], check: Callable[[Any], None]
) -> None:
    shrunk = _search(CATALOGUE[name], strategy, check)
    scenario = shrunk if isinstance(shrunk, Scenario) else shrunk[0]
    if isinstance(scenario, Scenario):
        assert scenario.world_size == 1 and len(scenario.model.branches) == 2, (
            f"{name}: not shrunk: {scenario}"
        )
    else:  # a corrupted bucket assignment: of a one-branch model
        params = shrunk[0]
        assert len(params) <= 2, f"{name}: not shrunk: {len(params)} parameters"
    check(shrunk)  # the real reducer passes the same example


@pytest.mark.parametrize("name", sorted(SEARCHES))
def test_the_searching_properties_catch(name: str) -> None:
    with applied(CATALOGUE[name]):
        assert _fails(SEARCHES[name]), f"{name}: the search still succeeds"
    SEARCHES[name]()  # the real code passes


def test_applying_a_mutant_replaces_the_code_and_restores_it() -> None:
    real = reducer.Reducer
    with applied(CATALOGUE["skip the divide"]):
        assert reducer.Reducer is not real and reducer.ddp._wrapper.Reducer is reducer.Reducer
    assert reducer.Reducer is real and reducer.ddp._wrapper.Reducer is real
    assert all(m.bug for m in CATALOGUE.values()), "every mutant describes its bug"
