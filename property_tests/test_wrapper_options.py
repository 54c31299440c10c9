"""Property 11: this project's DDP with torch's newest options is torch's DDP, bit for bit.

Both wrappers run on the same rank threads of one fake world, on copies of one model, fed the
same data, each with its own SGD optimizer, for two or three steps; the options drawn are the
ones no other property draws:

- ``init_sync`` (the ranks' models, buffer included, start different, seeded per rank, two
  times in three): with it, every rank starts from rank 0's parameters and buffers (the
  buffers even with ``forward_sync_buffers=False``, as torch); without it, each from its own;
- ``broadcast_buffers`` or ``forward_sync_buffers`` (a buffer forward updates from the rank's
  own data, and the gradients depend on it): synced from rank 0 at every forward, or not;
- ``bucket_cap_mb`` or ``bucket_cap_mb_list`` (a cap per bucket, the last repeating): the
  buckets the wrapper is built with, as torch's logging data reports them;
- ``bucket_cap_mb`` different on every rank (a misuse torch tolerates: one bucket in the
  first iteration, then rank 0's rebuilt buckets on every rank);
- ``_register_builtin_comm_hook`` (ALLREDUCE or FP16_COMPRESS), against the Python hooks
  torch's built-in ones compute the same as;
- ``static_graph=True`` or ``_set_static_graph()`` after construction, with a head no rank
  ever uses (without either, ``find_unused_parameters`` drawn, a head used on some ranks and
  steps only where it is on);
- ``gradient_as_bucket_view``.

Every rank's gradients, parameters and buffers after each step, the bucket sizes, and the
parameters' count and size in bytes in the logging data, must be torch's; the logging data's
times of the last iteration must be those of the iteration it sampled (the last). And the
two arguments this wrapper cannot honour (``delay_all_reduce_named_params``,
``param_to_hook_all_reduce``) are refused by name, never ignored. Two misuses of
construction are refused with what to do: no process group and no default group (the
message exactly), and a mixed-precision configuration with a field missing, not a dtype, or
a dtype gradients cannot be reduced in (an InvalidArgument naming the first such field and
its value, never a TypeError).
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import event, given
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import fakepg
import reducer
from reducer.testing.harness import note_size

# torch's C++ built-in hooks expect a C++ work's result, which the fake world's is not.
_TORCH_HOOKS = {
    "ALLREDUCE": default_hooks.allreduce_hook,
    "FP16_COMPRESS": default_hooks.fp16_compress_hook,
}
_BUILD = threading.Lock()  # torch's default generator is shared by the rank threads
PARAMETERS = 3  # the model below: inp, two heads (weights only)


@dataclass(frozen=True)
class OptionScenario:
    """One run of both wrappers with the same drawn options."""

    world_size: int
    steps: int
    per_rank_init: bool  # each rank seeds its model with its rank
    init_sync: bool
    buffers: tuple[str, bool] | None  # ("broadcast_buffers" or "forward_sync_buffers", value)
    caps: tuple[str, Any] | None  # ("bucket_cap_mb", MiB) or ("bucket_cap_mb_list", [MiB])
    hook: str | None  # None, "ALLREDUCE" or "FP16_COMPRESS"
    static: str | None  # None, "constructor" (static_graph=True) or "set" (_set_static_graph)
    find_unused: bool
    as_view: bool
    rank_caps: tuple[float, ...] | None = None  # bucket_cap_mb per rank, where drawn so

    def options_of(self, rank: int) -> dict[str, Any]:
        """The constructor's keyword arguments on ``rank``: :attr:`options`, with this
        rank's own ``bucket_cap_mb`` where the caps are drawn per rank."""
        options = self.options
        if self.rank_caps is not None:
            options["bucket_cap_mb"] = self.rank_caps[rank]
        return options

    @property
    def options(self) -> dict[str, Any]:
        """The constructor's keyword arguments, the same for both wrappers."""
        options: dict[str, Any] = {
            "init_sync": self.init_sync,
            "find_unused_parameters": self.find_unused,
            "gradient_as_bucket_view": self.as_view,
            "static_graph": self.static == "constructor",
        }
        if self.buffers is not None:
            options[self.buffers[0]] = self.buffers[1]
        if self.caps is not None:
            options[self.caps[0]] = self.caps[1]
        return options


_MIB = 1 << 20
# Caps around the model's parameter sizes (32 and 48 bytes): a bucket per parameter, a few,
# or one; 1 MiB and more: the first bucket's own limit decides.
_CAPS = st.sampled_from([0.0, 40 / _MIB, 100 / _MIB, 1.0, 2.0])
_CAP_LISTS = st.lists(st.sampled_from([40 / _MIB, 100 / _MIB, 1.0]), min_size=1, max_size=3)


# What torch's DDP takes here: the newest arguments are drawn only where it has them.
_TORCH_TAKES = frozenset(inspect.signature(nn.parallel.DistributedDataParallel).parameters)
_BUFFER_OPTIONS = ("broadcast_buffers", "forward_sync_buffers")
_CAP_OPTIONS = ("bucket_cap_mb", "bucket_cap_mb_list", None)


FOCUSES = ("init_sync", "buffers", "caps", "rank_caps", "hook", "static")


@st.composite
def option_scenarios(draw: st.DrawFn, focus: str | None = None) -> OptionScenario:
    """Both wrappers' options, each drawn; ``focus`` (one of :data:`FOCUSES`) always draws
    that option away from its default (its corner: models that start different per rank
    for ``init_sync``, two ranks or more for the buffers, the search for unused parameters
    for the caps, where their buckets are compared; a different ``bucket_cap_mb`` on every
    rank, two ranks or more and no search for unused parameters, for the per-rank caps:
    torch rebuilds buckets only without the search, and the ranks' first buckets, by cap,
    would not match before it)."""
    many = ("init_sync", "buffers", "rank_caps")
    worlds = [2, 3, 3, 4] if focus in many else [1, 2, 3, 3, 4]
    world = draw(st.sampled_from(worlds))
    statics = ["constructor", "set"] if focus == "static" else [None, None, "constructor", "set"]
    static = None if focus == "caps" else draw(st.sampled_from(statics))
    cap_names = [n for n in _CAP_OPTIONS if n is None or n in _TORCH_TAKES]
    if focus == "caps":
        cap_names.remove(None)
    if focus == "rank_caps":
        cap_names = [None]  # the caps come per rank, below
    caps = draw(
        st.sampled_from(cap_names).flatmap(
            lambda name: (
                st.none()
                if name is None
                else st.tuples(st.just(name), _CAPS if name == "bucket_cap_mb" else _CAP_LISTS)
            )
        )
    )
    buffer_names = [n for n in _BUFFER_OPTIONS if n in _TORCH_TAKES]
    buffers = draw(
        st.sampled_from(buffer_names if focus == "buffers" else [None, *buffer_names]).flatmap(
            lambda name: (
                st.none()
                if name is None
                else st.tuples(st.just(name), st.sampled_from([False, True]))
            )
        )
    )
    hooks = (
        ["FP16_COMPRESS", "ALLREDUCE"] if focus == "hook" else [None, "ALLREDUCE", "FP16_COMPRESS"]
    )
    return OptionScenario(
        world_size=world,
        steps=draw(st.integers(2, 3)),
        per_rank_init=focus == "init_sync" or draw(st.sampled_from([True, True, False])),
        init_sync=draw(st.sampled_from([True, False])),
        buffers=buffers,
        caps=caps,
        hook=draw(st.sampled_from(hooks)),
        static=static,
        find_unused=focus == "caps"
        or (static is None and focus != "rank_caps" and draw(st.booleans())),
        as_view=draw(st.booleans()),
        rank_caps=(
            tuple(draw(st.lists(_CAPS, min_size=world, max_size=world, unique=True)))
            if focus == "rank_caps"
            else None
        ),
    )


class _Net(nn.Module):
    """A trunk, a running mean of its output (a buffer the gradients depend on), two heads:
    head 1 runs only where ``second`` says."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 4, bias=False)
        self.heads = nn.ModuleList([nn.Linear(4, 2, bias=False), nn.Linear(4, 2, bias=False)])
        self.register_buffer("mean", torch.rand(4))  # per rank where the seed is

    def forward(self, x: Tensor, second: bool) -> Tensor:
        h = torch.tanh(self.inp(x))
        with torch.no_grad():
            self.mean.mul_(0.5).add_(h.mean(0), alpha=0.5)
        out: Tensor = self.heads[0](h + self.mean)
        if second:
            out = out + self.heads[1](h)
        return out


def _build(seed: int) -> _Net:
    with _BUILD:
        torch.manual_seed(seed)
        return _Net()


def _second(s: OptionScenario, rank: int, step: int) -> bool:
    """Whether head 1 runs: never under a static graph, on some ranks and steps only where
    unused parameters are searched for, else always."""
    if s.static is not None:
        return False
    return not s.find_unused or (rank + step) % 2 == 0


Trace = list[tuple[list[Tensor | None], list[Tensor], list[Tensor]]]  # grads, params, buffers


def _run(s: OptionScenario) -> list[tuple[tuple[Trace, Any], tuple[Trace, Any]]]:
    """Per rank, for this project's wrapper then torch's: the trace of every step and its
    logging data after the last."""

    def fn(pg: fakepg.FakeProcessGroup) -> tuple[tuple[Trace, Any], tuple[Trace, Any]]:
        torch.get_num_threads()  # this thread's intra-op thread count, before any kernel
        rank = pg.rank()
        seed = rank if s.per_rank_init else 0
        models = [_build(seed), _build(seed)]
        ours = reducer.DistributedDataParallel(models[0], **s.options_of(rank))
        theirs = nn.parallel.DistributedDataParallel(models[1], **s.options_of(rank))
        out = []
        for ddp, model in zip((ours, theirs), models, strict=True):
            if s.static == "set":
                ddp._set_static_graph()
            if s.hook is not None and ddp is ours:
                ddp._register_builtin_comm_hook(getattr(dist.BuiltinCommHookType, s.hook))
            elif s.hook is not None:  # the Python hooks its C++ ones compute the same as
                ddp.register_comm_hook(None, _TORCH_HOOKS[s.hook])
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            trace: Trace = []
            for step in range(s.steps):
                optimizer.zero_grad(set_to_none=True)
                x = torch.randn(4, 3, generator=torch.Generator().manual_seed(10 * step + rank))
                ddp(x, _second(s, rank, step)).square().sum().backward()
                grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
                optimizer.step()
                params = [p.detach().clone() for p in model.parameters()]
                trace.append((grads, params, [b.clone() for b in model.buffers()]))
            out.append((trace, ddp._get_ddp_logging_data()))
        return out[0], out[1]

    return fakepg.run_torch(fn, s.world_size, timeout=30.0)


def _same(ours: Tensor | None, theirs: Tensor | None, where: str) -> None:
    if theirs is None or ours is None:
        assert ours is None and theirs is None, f"{where}: torch's {theirs}, ours {ours}"
        return
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, where
    assert torch.equal(ours.view(-1).view(torch.uint8), theirs.view(-1).view(torch.uint8)), (
        f"{where}: not bit-identical: ours {ours.flatten().tolist()}, torch's "
        f"{theirs.flatten().tolist()}"
    )


# Logging data that must be torch's: the buckets the wrapper was built with, the parameters'
# count and size in bytes. (Not torch's sampled "iteration": in this fake world torch's
# logger reports the last or the one before, from one run of an example to the next.)
_LOGGED = ("bucket_sizes", "num_parameter_tensors", "total_parameter_size_bytes")
# The last iteration's times, as fields (ms) and as torch's keys for the sampled one (ns).
_TIMES = (
    ("backward_compute_ms", "backward_compute_time"),
    ("comm_ms", "backward_comm_time"),
    ("overlap_ms", "backward_compute_comm_overlap_time"),
)


def _check_logging(s: OptionScenario, rank: int, ours: dict[str, Any], theirs: Any) -> None:
    """Our logging data has torch's values for :data:`_LOGGED`, and, as torch's, no error
    where none was logged; its sampled iteration is the
    last (the first 10 are all sampled), so each of its times (ns) is the last iteration's
    field (ms), exactly."""
    for key in _LOGGED:
        assert ours[key] == theirs[key], f"rank {rank}: {key} {ours[key]}, torch's {theirs[key]}"
    for key in ("has_error", "error"):  # no error was logged: neither reports one
        assert (key in ours) == (key in theirs), f"rank {rank}: {key} {ours.get(key)!r}"
    assert ours["iteration"] == s.steps - 1, ours["iteration"]
    for field, key in _TIMES:
        assert ours[field] == ours[key] * 1e-6, f"rank {rank}: {field} {ours[field]}, {key}"


def check_options(s: OptionScenario) -> None:
    """The property: every rank's gradients, parameters and buffers after every step, and
    the bucket sizes before and after the rebuild, are torch's; so are the other logging data
    of :data:`_LOGGED`, and the last iteration's times agree with the sampled ones."""
    names = [n for n, _ in _build(0).named_parameters()]
    for rank, ((ours, our_log), (theirs, their_log)) in enumerate(_run(s)):
        our_sizes, their_sizes = our_log.get("bucket_sizes"), their_log.get("bucket_sizes")
        for step, (mine, torchs) in enumerate(zip(ours, theirs, strict=True)):
            where = f"rank {rank}, step {step}"
            for kind, a, b in zip(("grad", "param"), mine[:2], torchs[:2], strict=True):
                for name, x, y in zip(names, a, b, strict=True):
                    _same(x, y, f"{kind} of {name}, {where}")
            for x, y in zip(mine[2], torchs[2], strict=True):
                _same(x, y, f"buffer mean, {where}")
        # (Both report the buckets they were built with: see property_tests/test_ddp_buckets.py
        # for the buckets of every iteration, as comm hooks see them.)
        assert our_sizes == their_sizes, f"rank {rank}: buckets {our_sizes}, torch's {their_sizes}"
        _check_logging(s, rank, our_log, their_log)


@pytest.mark.parametrize("focus", FOCUSES)
@given(data=st.data())
def test_this_projects_ddp_is_torchs_with_its_newest_options(
    focus: str, data: st.DataObject
) -> None:
    # One test per option drawn away from its default: each gets the profile's examples.
    s = data.draw(option_scenarios(focus))
    note_size(PARAMETERS, s.world_size)
    event(f"static: {s.static}, hook: {s.hook}, caps: {s.caps and s.caps[0]}")
    event(f"caps per rank: {s.rank_caps is not None}")
    event(f"init_sync={s.init_sync}, per-rank init: {s.per_rank_init}; buffers: {s.buffers}")
    check_options(s)


_REFUSED = ("delay_all_reduce_named_params", "param_to_hook_all_reduce")


@st.composite
def refused_options(draw: st.DrawFn) -> dict[str, Any]:
    """One or both of the arguments this wrapper refuses, with a value torch would take."""
    names = draw(st.sets(st.sampled_from(_REFUSED), min_size=1))
    return {name: draw(st.sampled_from([[("inp.weight", None)], [], ()])) for name in names}


def check_refused(options: dict[str, Any]) -> None:
    """The property: construction raises ``reducer.InvalidArgument`` naming the first refused
    argument (in torch's order), before any collective."""

    def fn(pg: fakepg.FakeProcessGroup) -> None:
        first = next(name for name in _REFUSED if name in options)
        with pytest.raises(reducer.InvalidArgument, match=first):
            reducer.DistributedDataParallel(_build(0), pg, **options)

    fakepg.run(fn, 1, timeout=20.0)


@given(refused_options())
def test_arguments_this_wrapper_cannot_honour_are_refused_by_name(options: dict[str, Any]) -> None:
    event(f"refused: {sorted(options)}")
    check_refused(options)


_NO_GROUP = (
    "DistributedDataParallel: no process_group was given, and torch.distributed has no default "
    "group to use instead; call torch.distributed.init_process_group(...) first (torchrun sets "
    "its environment), or pass process_group=, e.g. a reducer.TorchProcessGroup or "
    "fakepg.World(n).group(rank)"
)


def check_no_group(how: str, seed: int) -> None:
    """The property: with no process group given (left out, None in torch's ``device_ids``
    place, or ``process_group=None``) and no default group, construction raises
    ``reducer.InvalidArgument`` with exactly the message that says what to do."""
    assert not dist.is_initialized()  # the property's premise: no default group
    args: tuple[Any, ...] = (None,) if how == "positional None" else ()
    kwargs: dict[str, Any] = {"process_group": None} if how == "process_group=None" else {}
    with pytest.raises(reducer.InvalidArgument) as info:
        reducer.DistributedDataParallel(_build(seed), *args, **kwargs)
    assert str(info.value) == _NO_GROUP


@given(st.sampled_from(["left out", "positional None", "process_group=None"]), st.integers(0, 3))
def test_no_group_and_no_default_group_is_refused_with_what_to_do(how: str, seed: int) -> None:
    event(f"group: {how}")
    check_no_group(how, seed)


_MP_FIELDS = ("param_dtype", "reduce_dtype", "buffer_dtype")
_VALID_DTYPES = (None, torch.float16, torch.bfloat16, torch.float32)
_MISSING = object()  # a field the configuration does not have


@st.composite
def mixed_precision_configs(draw: st.DrawFn) -> tuple[SimpleNamespace, str, str]:
    """A mixed-precision configuration with at least one invalid field, the first invalid
    field (in torch's order), and a pattern its refusal must match: a field missing, not a
    dtype (a dtype's name, a number), an integer or complex dtype, or a storage-only float."""
    invalid: dict[str, tuple[object, str]] = {
        "missing": (_MISSING, "is missing"),
        "a name": ("float16", "is 'float16'"),
        "a number": (16, "is 16"),
        "integer": (torch.int32, r"is torch\.int32, which is not a real floating-point"),
        "complex": (torch.complex64, r"is torch\.complex64, which is not a real floating-point"),
        "float8": (torch.float8_e4m3fn, r"is torch\.float8_e4m3fn, a storage-only"),
    }
    first = draw(st.sampled_from(_MP_FIELDS))
    kind = draw(st.sampled_from(sorted(invalid)))
    fields: dict[str, object] = {}
    for field in _MP_FIELDS:
        if _MP_FIELDS.index(field) < _MP_FIELDS.index(first):
            fields[field] = draw(st.sampled_from(_VALID_DTYPES))
        elif field == first:
            fields[field] = invalid[kind][0]
        else:  # after the first invalid one: anything, valid or not
            fields[field] = draw(
                st.sampled_from(_VALID_DTYPES) | st.sampled_from([v for v, _ in invalid.values()])
            )
    config = SimpleNamespace(**{k: v for k, v in fields.items() if v is not _MISSING})
    return config, first, invalid[kind][1]


def check_invalid_mixed_precision(case: tuple[SimpleNamespace, str, str]) -> None:
    """The property: construction raises ``reducer.InvalidArgument`` (a ValueError, never a
    TypeError from checking it) naming the first invalid field and what it holds."""
    config, field, pattern = case

    def fn(pg: fakepg.FakeProcessGroup) -> None:
        with pytest.raises(reducer.InvalidArgument, match=rf"\b{field} {pattern}"):
            reducer.DistributedDataParallel(_build(0), pg, mixed_precision=config)

    fakepg.run(fn, 1, timeout=20.0)


@given(mixed_precision_configs())
def test_an_invalid_mixed_precision_field_is_named(case: tuple[SimpleNamespace, str, str]) -> None:
    event(f"invalid: {case[1]} {case[2]}")
    check_invalid_mixed_precision(case)
