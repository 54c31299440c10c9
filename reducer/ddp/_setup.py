"""What ``DistributedDataParallel``'s constructor settles before it builds a reducer.

torch's arguments, taken as torch takes them: the process group (none: torch.distributed's
default group), the device of a module on one device per process, the parameters and
buffers to ignore; arguments this wrapper cannot honour are refused by name. Then what makes
every rank start alike: the same parameters (count, dtype, shape, strides, requires_grad)
everywhere, and one rank's values broadcast to all. Errors raised here are
:class:`reducer.InvalidArgument` (a ``ValueError``), or :class:`reducer.InvalidModel` (also a
``RuntimeError``) where torch's DDP raises ``RuntimeError``.

# Note [A torch group that carries its own ProcessGroup]
# fakepg's torch backend is a torch.distributed group whose collectives forward to a
# FakeProcessGroup, which it exposes as ``fake_group``. Given such a group (the default group
# under fakepg.run_torch), the wrapper reduces over that ProcessGroup directly: the same
# collectives in the same order, without the adapter's hop, so results stay bit-exact. reducer
# never imports fakepg: any torch group whose ``fake_group`` implements reducer.ProcessGroup is
# used that way, and every other torch group goes through reducer.TorchProcessGroup.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from reducer.errors import InvalidArgument, InvalidArgumentType, InvalidModel, describe_param
from reducer.process_group import ProcessGroup, ReduceOp
from reducer.torch_backend import TorchProcessGroup
from reducer.validation import check_process_group

__all__: list[str] = []

_WHO = "DistributedDataParallel"


# -------------------------------------------------------------------------------------------
# The process group. See Note [A torch group that carries its own ProcessGroup].


def names_devices(obj: object) -> bool:
    """Whether the argument in torch's ``device_ids`` place is meant as device ids: None, a
    list of devices, or a single device (refused later, with what to pass). Anything else
    there (``DistributedDataParallel(model, pg)``) is taken as the process group."""
    return obj is None or isinstance(obj, Sequence | int | torch.device)


def resolve_process_group(group: object) -> tuple[ProcessGroup, dist.ProcessGroup | None]:
    """The group to reduce over, and the torch.distributed group under it, if any.

    ``None`` means torch.distributed's default group, as in torch's DDP. A torch group is
    wrapped in :class:`reducer.TorchProcessGroup`, unless it carries a ProcessGroup of its
    own; a :class:`reducer.ProcessGroup` is used as it is.
    """
    if group is None:
        if not dist.is_initialized():
            raise InvalidArgument(
                f"{_WHO}: no process_group was given, and torch.distributed has no default "
                "group to use instead; call torch.distributed.init_process_group(...) first "
                "(torchrun sets its environment), or pass process_group=, e.g. a "
                "reducer.TorchProcessGroup or fakepg.World(n).group(rank)"
            )
        group = dist.group.WORLD
    if isinstance(group, dist.ProcessGroup):
        own = getattr(group, "fake_group", None)
        if isinstance(own, ProcessGroup):
            return own, group
        return TorchProcessGroup(group), group
    check_process_group(group)
    assert isinstance(group, ProcessGroup)  # check_process_group refuses anything else
    if isinstance(group, TorchProcessGroup):
        return group, group.torch_group
    return group, _default_group_over(group)


def _default_group_over(group: ProcessGroup) -> dist.ProcessGroup | None:
    """torch's default group, if it forwards to ``group`` itself (fakepg.run_torch's ranks
    passing their FakeProcessGroup): then torch's Join can run over it too."""
    if not dist.is_initialized():
        return None
    default = dist.group.WORLD
    if default is not None and getattr(default, "fake_group", None) is group:
        return default
    return None


# -------------------------------------------------------------------------------------------
# Arguments.


def refuse_unsupported(
    *,
    delay_all_reduce_named_params: object,
    param_to_hook_all_reduce: object,
    check_reduction: object,
) -> None:
    """Refuse, by name, torch's arguments this wrapper cannot honour (none is ignored)."""
    refused = {
        "delay_all_reduce_named_params": (
            delay_all_reduce_named_params is not None,
            "every parameter is reduced in its bucket during backward; leave it None",
        ),
        "param_to_hook_all_reduce": (
            param_to_hook_all_reduce is not None,
            "it goes with delay_all_reduce_named_params, which is not supported; leave it None",
        ),
    }
    for name, (given, fix) in refused.items():
        if given:
            raise InvalidArgument(f"{_WHO}: {name} is not supported by this wrapper; {fix}")
    if check_reduction:
        # torch's DDP ignores it with this warning: the reducer always completes the reduction.
        warnings.warn(
            "The `check_reduction` argument in `DistributedDataParallel` module is deprecated. "
            "Please avoid using it.",
            FutureWarning,
            stacklevel=3,
        )


def warn_broadcast_buffers(broadcast_buffers: object, forward_sync_buffers: object) -> None:
    """torch 2.13's FutureWarning for the deprecated ``broadcast_buffers``, word for word."""
    if broadcast_buffers is None:
        return
    if forward_sync_buffers is not None:
        message = (
            "Both `broadcast_buffers` and `forward_sync_buffers` were specified. "
            "`broadcast_buffers` is deprecated and its value is ignored when "
            "`forward_sync_buffers` is provided."
        )
    else:
        message = (
            "`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead. "
            "IMPORTANT: unlike `broadcast_buffers=False`, `forward_sync_buffers=False` still "
            "syncs buffers at init. If you rely on buffers NOT being synced at init (e.g. "
            "rank-local buffers), keep using `broadcast_buffers=False` until "
            "`init_sync_buffers` is available."
        )
    warnings.warn(message, FutureWarning, stacklevel=3)


def mesh_group(device_mesh: Any, process_group: object) -> object:
    """The group of a one-dimensional ``device_mesh``, as torch's DDP takes it (its errors:
    RuntimeError, torch's phrases)."""
    if process_group is not None:
        raise InvalidModel(
            f"{_WHO}: Cannot specify both process_group and device_mesh arguments. Pass one: "
            "device_mesh=mesh for a one-dimensional mesh, or process_group=group"
        )
    ndim = getattr(device_mesh, "ndim", None)
    if ndim != 1:
        raise InvalidModel(
            f"{_WHO}: Only 1D device mesh is supported, but got {device_mesh}. For a mesh of "
            "several dimensions pass the data-parallel dimension's group: "
            "process_group=mesh.get_group(mesh_dim)"
        )
    return device_mesh.get_group(mesh_dim=0)


def refuse_cpu_sync_batchnorm(module: nn.Module, device_type: str) -> None:
    """torch's DDP refuses SyncBatchNorm in a CPU module (ValueError, torch's phrase):
    SyncBatchNorm's forward needs a GPU module."""
    if device_type != "cpu":
        return
    for name, layer in module.named_modules():
        if isinstance(layer, nn.SyncBatchNorm):
            raise InvalidArgument(
                f"{_WHO}: SyncBatchNorm layers only work with GPU modules; {name or 'the module'}"
                " is a SyncBatchNorm in a CPU module. Use nn.BatchNorm (per-rank statistics, "
                "buffers broadcast from rank 0), or move the module to a GPU"
            )


def bucket_limits(
    bucket_cap_mb: float | None,
    bucket_cap_mb_list: Sequence[float] | None,
    *,
    static_graph: bool,
    find_unused_parameters: bool,
) -> tuple[float, list[int], list[int]]:
    """The cap in MiB, the byte limits of the initial buckets and of the rebuilt ones, as
    torch 2.13's DDP sets them (``_BucketCapacityConfig``).

    With ``bucket_cap_mb_list`` (torch's per-bucket caps) both follow the list, the last
    entry repeating. Otherwise the first bucket's limit is 1 MiB where ``bucket_cap_mb`` is
    left at its default (25 MiB), and the cap itself where it is given; the rebuilt buckets
    take that first limit, then the cap. The initial buckets hold every parameter of a
    dtype and device in one (limit ``sys.maxsize``) unless unused parameters are searched
    for without a static graph: before the first iteration the order gradients become
    ready in is unknown, and only the search needs the buckets from the start. See Note
    [Rebuilding buckets] in reducer.ddp._wrapper.
    """
    mib = 1 << 20
    if bucket_cap_mb_list:
        if bucket_cap_mb is not None:
            raise InvalidArgument(
                f"{_WHO}: both bucket_cap_mb and bucket_cap_mb_list were given; pass one "
                "(bucket_cap_mb_list sets every bucket's cap, the last one repeating)"
            )
        caps = list(bucket_cap_mb_list)
        for cap in caps:
            _check_mib("bucket_cap_mb_list", cap)
        limits = [int(cap * mib) for cap in caps]
        return float(max(caps)), limits, limits
    cap = 25.0 if bucket_cap_mb is None else bucket_cap_mb
    # 0 is torch's too: every bucket closes at its first parameter (one per bucket).
    _check_mib("bucket_cap_mb", cap, zero=True)
    cap_bytes = int(cap * mib)
    first = mib if bucket_cap_mb is None else cap_bytes  # torch's _DEFAULT_FIRST_BUCKET_BYTES
    if static_graph or not find_unused_parameters:
        initial = [sys.maxsize]
    else:
        initial = [first, cap_bytes] if first < cap_bytes else [cap_bytes]
    return float(cap), initial, [first, cap_bytes]


def _check_mib(name: str, value: object, *, zero: bool = False) -> None:
    ok = isinstance(value, int | float) and (value >= 0 if zero else value > 0)
    if isinstance(value, bool) or not ok:
        bound = ">= 0 (0: one parameter per bucket)" if zero else "> 0"
        raise InvalidArgument(f"{_WHO}: {name} must be a number of MiB {bound}, got {value!r}")


def resolve_devices(
    params: Sequence[Tensor], device_ids: object, output_device: object
) -> tuple[list[int] | None, int | None, str]:
    """``device_ids`` and ``output_device`` as torch's DDP takes them, for one device per
    process; and the parameters' device type.

    A module on one accelerator may name it (``device_ids=[i]``): inputs are then moved
    there before forward. A CPU module, or one spread over several devices, names none.
    """
    if device_ids is not None and (
        isinstance(device_ids, int | str | torch.device) or not isinstance(device_ids, Sequence)
    ):
        raise InvalidArgumentType(  # a TypeError, as torch's len(device_ids) raises
            f"{_WHO}: device_ids must be a list of one device (device_ids=[local_rank]) or "
            f"None, got {device_ids!r}"
        )
    if device_ids is not None and len(device_ids) > 1:
        raise InvalidArgument(
            f"{_WHO}: device_ids={list(device_ids)!r} names several devices, but each process "
            "drives one (torch's DDP: device_ids can only be None or contain a single element)"
            "; start one process per device and pass device_ids=[local_rank]"
        )
    types = sorted({p.device.type for p in params})
    if len(types) > 1:
        raise InvalidArgument(
            f"{_WHO}: the module's parameters are on several types of device ({types}); put "
            "the whole module on one type of device"
        )
    device_type = types[0] if types else "cpu"
    devices = sorted({str(p.device) for p in params})
    if not device_ids or device_type == "cpu" or len(devices) > 1:
        # torch's test: a falsy output_device (None, or 0) is ignored, not refused.
        if device_ids or output_device:
            raise InvalidArgument(
                f"{_WHO}: device_ids={device_ids!r} and output_device={output_device!r} name a "
                f"device, but the module's parameters are on {', '.join(devices)}: they are "
                "for a module on one accelerator (device_ids=[i] for a module on cuda:i); for a "
                "CPU module, or one spread over several devices, pass neither"
            )
        return None, None, device_type
    index = _device_index(device_ids[0], device_type, "device_ids")
    if devices != [str(torch.device(device_type, index))]:
        raise InvalidArgument(
            f"{_WHO}: device_ids=[{index}] but the module's parameters are on {devices[0]}; "
            f"move the module first (module.to({str(torch.device(device_type, index))!r}))"
        )
    out = index if output_device is None else _device_index(output_device, device_type, "")
    if out != index:
        raise InvalidArgument(
            f"{_WHO}: output_device={output_device!r} differs from device_ids=[{index}]; with "
            "one device per process the outputs stay on the module's device (torch's DDP "
            "ignores output_device then); pass output_device=None or the same device"
        )
    return [index], out, device_type


def _device_index(device: object, device_type: str, what: str) -> int:
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    if isinstance(device, str | torch.device):
        parsed = torch.device(device)
        if parsed.type == device_type and parsed.index is not None:
            return parsed.index
    raise InvalidArgument(
        f"{_WHO}: {what or 'output_device'} must name a {device_type} device by index (0, or "
        f"'{device_type}:0'), got {device!r}"
    )


def move_inputs(
    inputs: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``inputs`` and ``kwargs`` with every tensor moved to ``device``, as torch's DDP moves
    them: through nested containers, namedtuples, dataclasses and PackedSequence, the copies
    on a side stream unless PYTORCH_DDP_USE_SIDE_STREAM=0. That is torch's private
    ``_to_kwargs``, used as it is rather than copied; this is the one place that calls it."""
    if not inputs and not kwargs:
        return inputs, kwargs
    from torch.distributed.utils import _to_kwargs

    side_stream = os.environ.get("PYTORCH_DDP_USE_SIDE_STREAM", "1") == "1"
    moved_inputs, moved_kwargs = _to_kwargs(inputs, kwargs, device, side_stream)
    return tuple(moved_inputs[0]), dict(moved_kwargs[0])


# -------------------------------------------------------------------------------------------
# Parameters and buffers to ignore.


def ignored_names(module: nn.Module) -> set[str]:
    """The names set by ``_set_params_and_buffers_to_ignore_for_model``, each checked to name
    a parameter or buffer of ``module`` (a misspelt name would silently be reduced)."""
    names = getattr(module, "_ddp_params_and_buffers_to_ignore", None)
    if names is None:
        return set()
    if isinstance(names, str) or not isinstance(names, Iterable):
        raise InvalidArgument(
            f"{_WHO}: the parameters and buffers to ignore must be a list of names, got {names!r}"
        )
    wanted = set(names)
    known = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    known |= {n for n, _ in module.named_buffers(remove_duplicate=False)}
    unknown = sorted(str(n) for n in wanted - known)
    if unknown:
        raise InvalidArgument(
            f"{_WHO}: {', '.join(map(repr, unknown[:5]))}"
            f"{' and more' if len(unknown) > 5 else ''}, given to "
            "_set_params_and_buffers_to_ignore_for_model, name no parameter or buffer of the "
            "module; use the names module.named_parameters() and module.named_buffers() give "
            "for the module being wrapped (e.g. 'fc.weight', not 'module.fc.weight')"
        )
    return wanted


def synced_parameters(module: nn.Module, ignore: set[str]) -> list[tuple[str, nn.Parameter]]:
    """The parameters no name of which is ignored, each once, in module order."""
    ignored = {id(p) for n, p in module.named_parameters(remove_duplicate=False) if n in ignore}
    return [(n, p) for n, p in module.named_parameters() if id(p) not in ignored]


BufferSlot = tuple[nn.Module, str]


def buffer_slots(module: nn.Module, ignore: set[str]) -> list[BufferSlot]:
    """Where the synced buffers live: (owning module, name), each buffer once.

    Found once, when the wrapper is built, as torch's DDP does: walking every submodule costs
    about a millisecond per forward on a model of a few hundred modules. A buffer registered
    later is not synced (nor is it by torch); one that a module reassigns (``self.n = self.n +
    1``: a new tensor under the same name) still is, since :func:`read_buffers` reads each by
    name, where torch keeps broadcasting the old tensor.
    """
    ignored = {id(b) for n, b in module.named_buffers(remove_duplicate=False) if n in ignore}
    seen: set[int] = set()
    slots: list[BufferSlot] = []
    for owner in module.modules():
        for name, buffer in owner.named_buffers(recurse=False):
            if id(buffer) in ignored or id(buffer) in seen:
                continue
            seen.add(id(buffer))
            slots.append((owner, name))
    return slots


def named_buffers(module: nn.Module, slots: Sequence[BufferSlot]) -> dict[str, Tensor]:
    """The synced buffers by their name in ``module`` (what buffer comm hooks get)."""
    prefixes = {id(m): f"{n}." if n else "" for n, m in module.named_modules()}
    result: dict[str, Tensor] = {}
    for owner, name in slots:
        buffer = getattr(owner, name, None)
        if isinstance(buffer, Tensor):
            result[prefixes.get(id(owner), "") + name] = buffer
    return result


def read_buffers(slots: Sequence[BufferSlot]) -> list[Tensor]:
    """The tensors the slots hold now (a buffer set to None is skipped)."""
    buffers = [getattr(owner, name, None) for owner, name in slots]
    return [b for b in buffers if isinstance(b, Tensor)]


# -------------------------------------------------------------------------------------------
# The same parameters on every rank.


def check_initialized(names: Sequence[str], params: Sequence[Tensor]) -> None:
    for i, p in enumerate(params):
        if isinstance(p, nn.parameter.UninitializedParameter):
            raise InvalidModel(
                f"{_WHO}: {describe_param(i, names)} is not initialized yet (a lazy module); "
                "run one forward pass of the model before wrapping it"
            )


# Every dtype torch knows, in a fixed order: the same codes on every rank (same torch).
_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
_MAX_DIMS = 8  # shapes and strides are compared up to this many dimensions, and by numel
_FIXED = 4  # dtype, requires_grad, dimensions, numel


def _fingerprint(p: Tensor) -> list[int]:
    """dtype, requires_grad, shape and strides of a parameter as ints (padded), comparable
    across ranks. Strides decide the bucket layout: see Note [Bucket views follow the
    parameter's strides] in reducer.buckets."""
    dtype = _DTYPES.index(p.dtype) if p.dtype in _DTYPES else len(_DTYPES)
    shape, strides = list(p.shape)[:_MAX_DIMS], list(p.stride())[:_MAX_DIMS]
    pad = [-1] * (_MAX_DIMS - len(shape))
    return [dtype, int(p.requires_grad), p.dim(), p.numel(), *shape, *pad, *strides, *pad]


def verify_same_parameters(names: list[str], params: list[Tensor], pg: ProcessGroup) -> None:
    """Every rank must hold the same parameters, or gradients would be mixed up silently.

    Two allgathers (counts, then one fingerprint per parameter); every rank sees every rank's
    data, so every rank raises the same error and none is left waiting in a collective. torch
    compares sizes and strides the same way (``_verify_param_shape_across_processes``).
    """
    world = pg.size()
    if world == 1:
        return
    device = params[0].device if params else torch.device("cpu")  # NCCL: device tensors
    count = torch.tensor([len(params)], dtype=torch.int64, device=device)
    per_rank = [int(c.item()) for c in _allgather(pg, count)]
    if len(set(per_rank)) > 1:
        listing = ", ".join(f"rank {r}: {n}" for r, n in enumerate(per_rank))
        raise InvalidModel(
            f"{_WHO}: ranks hold different numbers of parameters ({listing}); every rank "
            "must build the same model (same modules, same parameters to ignore) before "
            "wrapping it"
        )
    if not params:
        return
    mine = torch.tensor([_fingerprint(p) for p in params], dtype=torch.int64, device=device)
    theirs = [t.cpu() for t in _allgather(pg, mine)]
    for i in range(len(params)):
        differing = [r for r in range(1, world) if not torch.equal(theirs[r][i], theirs[0][i])]
        if differing:
            strides = _strides_differ([theirs[0][i], *(theirs[r][i] for r in differing)])
            others = ", ".join(
                f"rank {r} has {_describe(theirs[r][i], strides)}" for r in differing
            )
            raise InvalidModel(
                f"{_WHO}: {describe_param(i, names)} differs between ranks: rank 0 has "
                f"{_describe(theirs[0][i], strides)}, {others}. Every rank must build the same "
                "model (same modules in the same order, same shapes, dtypes, memory formats "
                "and requires_grad) before wrapping it"
            )


def _strides_differ(rows: list[Tensor]) -> bool:
    """Fingerprints that agree in dimensions and shape but not in strides (then the error
    shows the strides; otherwise the shapes tell the difference)."""
    shape, strides = slice(2, _FIXED + _MAX_DIMS), slice(_FIXED + _MAX_DIMS, None)
    return all(torch.equal(row[shape], rows[0][shape]) for row in rows) and any(
        not torch.equal(row[strides], rows[0][strides]) for row in rows
    )


def _allgather(pg: ProcessGroup, tensor: Tensor) -> list[Tensor]:
    gathered = [torch.empty_like(tensor) for _ in range(pg.size())]
    pg.allgather([gathered], [tensor]).wait()
    return gathered


def _describe(row: Tensor, with_strides: bool) -> str:
    dtype, requires_grad, ndim, numel, *rest = (int(x) for x in row.tolist())
    shape, strides = rest[:_MAX_DIMS], rest[_MAX_DIMS:]
    name = str(_DTYPES[dtype]).removeprefix("torch.") if dtype < len(_DTYPES) else "other dtype"
    if ndim > _MAX_DIMS:
        text = f"{name} with {ndim} dimensions, {numel} elements"
    else:
        text = f"{name} {tuple(shape[:ndim])}"
        if with_strides:
            text += f" with strides {tuple(strides[:ndim])}"
    return text if requires_grad else text + " (frozen: requires_grad=False)"


# -------------------------------------------------------------------------------------------
# One rank's values for all.


def broadcast_from(tensors: Sequence[Tensor], pg: ProcessGroup, root: int) -> None:
    """Copy rank ``root``'s values into every rank's tensors: one flat broadcast per
    dtype/device."""
    if pg.size() == 1 or not tensors:
        return
    groups: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        flats = {key: torch.cat([t.detach().reshape(-1) for t in ts]) for key, ts in groups.items()}
        pg.broadcast(list(flats.values()), root).wait()
        for key, ts in groups.items():
            offset = 0
            for t in ts:
                t.copy_(flats[key][offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def common_rank(pg: ProcessGroup, device: torch.device, candidate: bool) -> int:
    """The highest rank among those that pass ``candidate=True`` (every rank calls it).

    Under DDP's join, buffers and the final model come from a rank that still trains, or
    trained last, rather than from rank 0, which may have stopped early. Some rank is always
    a candidate there.
    """
    rank = torch.tensor([pg.rank() if candidate else -1], dtype=torch.int64, device=device)
    pg.allreduce([rank], ReduceOp.MAX).wait()
    chosen = int(rank.item())
    assert chosen >= 0, "no rank was a candidate"
    return chosen


def sync_bucket_indices(
    bucket_indices: Sequence[Sequence[int]], pg: ProcessGroup, device: torch.device
) -> list[list[int]]:
    """Rank 0's bucket indices, for every rank (torch's ``Reducer::sync_bucket_indices``).

    Each rank buckets its own ready order with its own limits; ranks built with different
    caps (``bucket_cap_mb`` per rank) would then start different collectives. As torch's,
    rank 0's buckets win: one broadcast of the flattened indices and the bucket count (its
    length, the parameter count plus one, is the same on every rank), then one of the
    bucket sizes, whose length every rank knows from the first.
    """
    flat = [i for bucket in bucket_indices for i in bucket]
    indices = torch.tensor([*flat, len(bucket_indices)], dtype=torch.int32, device=device)
    pg.broadcast([indices], 0).wait()
    received = [int(i) for i in indices.tolist()]
    count = received.pop()
    sizes = torch.tensor([len(b) for b in bucket_indices], dtype=torch.int32, device=device)
    if pg.rank() != 0:
        sizes = torch.empty(count, dtype=torch.int32, device=device)
    pg.broadcast([sizes], 0).wait()
    synced: list[list[int]] = []
    offset = 0
    for size in sizes.tolist():
        synced.append(received[offset : offset + int(size)])
        offset += int(size)
    return synced
