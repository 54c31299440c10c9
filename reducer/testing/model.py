"""Random models described by plain data, built the same way on every rank and in the reference.

A model is a set of *branches*, each a small stack of layers fed by an input of its own; the
loss adds up every active branch. Branches are kept tiny so one example runs in milliseconds,
except that a branch may be *wide* (see ``wide_width``), so that parameters above the reducer's
size thresholds are generated too. A branch marked optional can be switched off per rank and per
step, which is how parameters go unused. A branch may reuse the layers of an earlier branch
(shared parameters: a layer used twice). A branch may run under activation checkpointing
(``torch.utils.checkpoint``, reentrant or not), as transformer blocks do. Parameters are
initialized from a local generator seeded by the spec, so building is deterministic and safe
from any thread (torch's global generator is shared by all).

The outputs come as a list, one per active branch, or packed by an :data:`OutputLayout` into
any nesting of lists, tuples, dicts, namedtuples and dataclasses, as real models return them
(a head's loss, logits and an auxiliary output in a dict or a ``ModelOutput``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

# "proj" is a Linear without bias (one parameter, as attention projections are): the first
# kind, so that shrinking, which prefers earlier choices, reaches the fewest parameters.
KINDS = ("proj", "linear", "mlp", "layernorm", "conv1d", "conv2d", "embedding")
# How a branch's layers run: plainly, or under activation checkpointing, whose reentrant form
# runs the branch's backward as a backward pass of its own, nested in the outer one.
CHECKPOINTS = ("none", "nonreentrant", "reentrant")
# Kinds whose output a ``head`` Linear can sit on (the others end in a Linear or LayerNorm).
HEAD_KINDS = ("conv1d", "conv2d", "embedding")
EMBEDDING_ROWS = 6
# Elements of the first weight of a wide branch: as many as the reducer's size-dependent
# paths need (its division fused into the copy starts at 2**16 elements), and no more.
LARGE_NUMEL = 1 << 16


def wide_width(out: int) -> int:
    """Input features that give an ``out``-feature Linear a weight of ``LARGE_NUMEL`` or more."""
    return -(-LARGE_NUMEL // out)


# Parameters each kind of layer stack owns (conv2d has no bias; a head adds weight and bias).
_PARAMS = {
    "proj": 1,
    "linear": 2,
    "mlp": 3,
    "layernorm": 4,
    "conv1d": 2,
    "conv2d": 1,
    "embedding": 1,
}
# Per kind, how many positions the head flattens: embedding looks up 3 indices per sample,
# conv1d maps length 4 to 3, conv2d maps 3x3 to 2x2.
_HEAD_POSITIONS = {"embedding": 3, "conv1d": 3, "conv2d": 4}


@dataclass(frozen=True, slots=True)
class BranchSpec:
    """One branch: ``kind`` of layers, in ``dtype``, mapping ``width`` features to ``out``.

    ``sparse`` (embedding only) gives the embedding a sparse gradient. ``optional`` branches
    can be switched off. ``shared_with`` names an earlier branch whose layers this one reuses
    (on an input of its own), so their parameters get gradients from both. ``head`` (conv and
    embedding only) stacks a Linear on the flattened output. ``checkpoint`` (one of
    ``CHECKPOINTS``) runs the layers under ``torch.utils.checkpoint``; a reentrant one gets an
    input that requires grad (reentrant checkpointing gives no parameter gradient otherwise),
    so it is not for embeddings, whose input is indices.
    """

    kind: str
    dtype: torch.dtype = torch.float32
    width: int = 3
    out: int = 2
    sparse: bool = False
    optional: bool = False
    shared_with: int | None = None
    head: bool = False
    checkpoint: str = "none"

    @property
    def parameter_count(self) -> int:
        """Parameters this branch's layers own (0 for a branch that reuses another's)."""
        if self.shared_with is not None:
            return 0
        return _PARAMS[self.kind] + (2 if self.head else 0)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A whole model: its branches and the seed of its initial parameters."""

    branches: tuple[BranchSpec, ...]
    seed: int = 0

    @property
    def optional_branches(self) -> list[int]:
        return [i for i, b in enumerate(self.branches) if b.optional]

    @property
    def parameter_count(self) -> int:
        """How many parameters the built model has."""
        return sum(b.parameter_count for b in self.branches)

    def owner(self, branch: int) -> int:
        """The branch whose layers ``branch`` runs (itself unless shared)."""
        shared = self.branches[branch].shared_with
        return branch if shared is None else shared

    def parameter_owners(self) -> tuple[int, ...]:
        """Per parameter index (``model.parameters()`` order), the branch that owns it."""
        return tuple(
            b for b, branch in enumerate(self.branches) for _ in range(branch.parameter_count)
        )

    def users(self, owner: int) -> list[int]:
        """The branches that run ``owner``'s layers (itself and those sharing them)."""
        return [b for b in range(len(self.branches)) if self.owner(b) == owner]

    @property
    def has_sparse(self) -> bool:
        return any(b.sparse for b in self.branches)

    @property
    def has_reentrant(self) -> bool:
        return any(b.checkpoint == "reentrant" for b in self.branches)


def _layers(spec: BranchSpec) -> nn.Module:
    base = _base_layers(spec)
    if not spec.head:
        return base
    if spec.kind not in HEAD_KINDS:
        raise ValueError(f"a {spec.kind!r} branch takes no head; only {HEAD_KINDS} do")
    flat = _HEAD_POSITIONS[spec.kind] * spec.out
    return nn.Sequential(base, nn.Flatten(1), nn.Linear(flat, spec.out, dtype=spec.dtype))


def _base_layers(spec: BranchSpec) -> nn.Module:
    w, o, dt = spec.width, spec.out, spec.dtype
    if spec.kind == "proj":
        return nn.Linear(w, o, bias=False, dtype=dt)
    if spec.kind == "linear":
        return nn.Linear(w, o, dtype=dt)
    if spec.kind == "mlp":
        return nn.Sequential(
            nn.Linear(w, o, dtype=dt), nn.Tanh(), nn.Linear(o, o, bias=False, dtype=dt)
        )
    if spec.kind == "layernorm":
        return nn.Sequential(nn.Linear(w, o, dtype=dt), nn.LayerNorm(o, dtype=dt))
    if spec.kind == "conv1d":
        return nn.Conv1d(w, o, kernel_size=2, dtype=dt)
    if spec.kind == "conv2d":
        return nn.Conv2d(w, o, kernel_size=2, bias=False, dtype=dt)
    if spec.kind == "embedding":
        return nn.Embedding(EMBEDDING_ROWS, o, sparse=spec.sparse, dtype=dt)
    raise ValueError(f"unknown branch kind {spec.kind!r}; expected one of {KINDS}")


class GeneratedModel(nn.Module):
    """The module a :class:`ModelSpec` describes. ``forward`` returns one output per branch."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        owned: list[nn.Module] = []
        for i, branch in enumerate(spec.branches):
            owned.append(
                owned[spec.owner(i)] if branch.shared_with is not None else _layers(branch)
            )
        self.branches = nn.ModuleList(owned)
        # One draw for all parameters, split in parameter order: the same values every build.
        params = list(self.parameters())
        gen = torch.Generator().manual_seed(spec.seed)
        values = torch.randn(sum(p.numel() for p in params), generator=gen, dtype=torch.float64)
        with torch.no_grad():
            offset = 0
            for p in params:
                p.copy_(values[offset : offset + p.numel()].view(p.shape) * 0.5)
                offset += p.numel()

    def forward(
        self,
        inputs: Sequence[Tensor],
        active: frozenset[int],
        layout: OutputLayout | None = None,
    ) -> Any:
        """One output per active branch, in branch order; packed by ``layout`` if given."""
        outputs = {
            i: self._branch(i, inputs[i]) for i in range(len(self.spec.branches)) if i in active
        }
        if layout is None:
            return list(outputs.values())
        return pack(layout, outputs)

    def _branch(self, i: int, x: Tensor) -> Tensor:
        layers = self.branches[i]
        mode = self.spec.branches[i].checkpoint
        if mode == "none":
            out: Tensor = layers(x)
            return out
        # The layers draw no random numbers: no RNG state to stash (torch's global one, which
        # the rank threads share, would be read and set from every thread).
        if mode == "reentrant":
            # Reentrant checkpointing differentiates only if some input requires grad.
            x = x.detach().requires_grad_()
        out = checkpoint(layers, x, use_reentrant=mode == "reentrant", preserve_rng_state=False)
        return out


def build_model(spec: ModelSpec) -> GeneratedModel:
    return GeneratedModel(spec)


def branch_inputs(spec: ModelSpec, seed: int, batch: int = 2) -> list[Tensor]:
    """One input per branch, from a local generator: the same on every call with ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    inputs = []
    for i in range(len(spec.branches)):
        owner = spec.branches[spec.owner(i)]  # a shared branch takes its owner's input format
        kind, w, dtype = owner.kind, owner.width, owner.dtype
        if kind == "embedding":
            inputs.append(torch.randint(0, EMBEDDING_ROWS, (batch, 3), generator=gen))
        elif kind == "conv1d":
            inputs.append(torch.randn(batch, w, 4, generator=gen, dtype=dtype))
        elif kind == "conv2d":
            inputs.append(torch.randn(batch, w, 3, 3, generator=gen, dtype=dtype))
        else:
            inputs.append(torch.randn(batch, w, generator=gen, dtype=dtype))
    return inputs


# -------------------------------------------------------------------------------------------
# Nested outputs.

# A container kind and its children, each a branch index (that branch's output) or a container.
OutputLayout = tuple[str, tuple[Union[int, "OutputLayout"], ...]]
CONTAINERS = ("list", "tuple", "dict", "namedtuple", "dataclass")


def pack(layout: OutputLayout, outputs: Mapping[int, Tensor]) -> Any:
    """``outputs`` (branch index -> output) nested as ``layout`` says. An inactive branch's
    slot is left out of lists, tuples and dicts, and None in namedtuples and dataclasses
    (whose fields are fixed), as real models leave out a head they did not run."""
    kind, children = layout
    values = [pack(c, outputs) if isinstance(c, tuple) else outputs.get(c) for c in children]
    if kind == "list":
        return [v for v in values if v is not None]
    if kind == "tuple":
        return tuple(v for v in values if v is not None)
    if kind == "dict":
        return {f"out{k}": v for k, v in enumerate(values) if v is not None}
    if kind == "namedtuple":
        return _namedtuple(len(values))(*values)
    if kind == "dataclass":
        return _dataclass(len(values))(*values)
    raise ValueError(f"unknown container {kind!r}; expected one of {CONTAINERS}")


def unpack(layout: OutputLayout, packed: Any, active: frozenset[int]) -> dict[int, Tensor]:
    """The inverse of :func:`pack` for the ``active`` branches: branch index -> its output
    as found in ``packed`` (which a DDP wrapper may have rebuilt with other tensors)."""
    kind, children = layout
    if kind in ("list", "tuple"):
        present = [c for c in children if isinstance(c, tuple) or c in active]
        items = list(packed)
    elif kind == "dict":
        present = [c for c in children if isinstance(c, tuple) or c in active]
        keys = [f"out{k}" for k, c in enumerate(children) if isinstance(c, tuple) or c in active]
        items = [packed[k] for k in keys]
    else:
        present = list(children)
        fields = dataclasses.fields(packed) if kind == "dataclass" else None
        items = [getattr(packed, f.name) for f in fields] if fields is not None else list(packed)
    if len(items) != len(present):
        raise AssertionError(f"a {kind} of {len(items)} items where {len(present)} were packed")
    found: dict[int, Tensor] = {}
    for child, item in zip(present, items, strict=True):
        if isinstance(child, tuple):
            found.update(unpack(child, item, active))
        elif child in active:
            if not isinstance(item, Tensor):
                raise AssertionError(f"branch {child}'s output is a {type(item).__name__}")
            found[child] = item
    return found


@functools.cache
def _namedtuple(size: int) -> type[Any]:
    return collections.namedtuple(f"Heads{size}", [f"h{i}" for i in range(size)])


@functools.cache
def _dataclass(size: int) -> type[Any]:
    return dataclasses.make_dataclass(
        f"HeadOutputs{size}", [(f"h{i}", Any, None) for i in range(size)]
    )


def loss_of(outputs: Sequence[Tensor]) -> Tensor:
    """The scalar every rank differentiates: sum of squares of every output, in float64."""
    total = torch.zeros((), dtype=torch.float64)
    for out in outputs:
        total = total + out.double().pow(2).sum()
    return total


def sparse_flags(model: nn.Module) -> list[bool]:
    """Per parameter: does it get a sparse gradient?"""
    flags = []
    for module in model.modules():
        sparse = isinstance(module, nn.Embedding) and module.sparse
        flags += [sparse] * len(list(module.parameters(recurse=False)))
    # Shared modules appear once in model.parameters(); modules() also dedups, same order.
    assert len(flags) == len(list(model.parameters()))
    return flags
