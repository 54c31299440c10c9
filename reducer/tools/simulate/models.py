"""The built-in models of ``python -m reducer simulate``: small, self-contained, no downloads.

Each model has optional *branches*: parameters used only when the branch is active in a given
forward pass (``forward(x, active=(True, False))``), so that the simulation can make
parameters unused on some ranks, or on all (see :func:`branch_pattern`). Every model also
makes its own batches (inputs and targets from a generator) and its loss. ``width`` scales
the model, to give the bucket sweep something to bucket.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional

__all__: list[str] = []

UNUSED_PATTERNS = ("none", "random", "rank-skew")


class _SimModule(nn.Module):
    """A model with optional branches, its batches and its loss."""

    branches: tuple[str, ...] = ()

    def make_batch(self, generator: torch.Generator, batch_size: int) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def loss(self, output: Tensor, target: Tensor) -> Tensor:
        return functional.cross_entropy(output, target)


class MLP(_SimModule):
    """Linear layers with ReLU; branches ``aux_a`` and ``aux_b`` add residual layers."""

    branches = ("aux_a", "aux_b")

    def __init__(self, width: int, depth: int = 3, inputs: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.inputs, self.classes = inputs, classes
        self.stem = nn.Linear(inputs, width)
        self.trunk = nn.ModuleList(nn.Linear(width, width) for _ in range(depth - 1))
        self.aux_a = nn.Linear(width, width)
        self.aux_b = nn.Linear(width, width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: Tensor, active: Sequence[bool] = (True, True)) -> Tensor:
        h = functional.relu(self.stem(x))
        for i, layer in enumerate(self.trunk):
            h = functional.relu(layer(h))
            if i == 0 and active[0]:
                h = h + functional.relu(self.aux_a(h))
        if active[1]:
            h = h + functional.relu(self.aux_b(h))
        out: Tensor = self.head(h)
        return out

    def make_batch(self, generator: torch.Generator, batch_size: int) -> tuple[Tensor, Tensor]:
        x = torch.randn(batch_size, self.inputs, generator=generator)
        return x, torch.randint(0, self.classes, (batch_size,), generator=generator)


class ConvNet(_SimModule):
    """Two convolutions with batch norm (a buffer to broadcast), pooling and a linear head;
    branch ``refine`` adds a residual convolution."""

    branches = ("refine",)

    def __init__(self, width: int, classes: int = 10, image: int = 16) -> None:
        super().__init__()
        self.classes, self.image = classes, image
        self.conv1 = nn.Conv2d(3, width, 3, padding=1)
        self.norm = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, stride=2, padding=1)
        self.refine = nn.Conv2d(2 * width, 2 * width, 3, padding=1)
        self.head = nn.Linear(2 * width, classes)

    def forward(self, x: Tensor, active: Sequence[bool] = (True,)) -> Tensor:
        h = functional.relu(self.norm(self.conv1(x)))
        h = functional.relu(self.conv2(h))
        if active[0]:
            h = h + functional.relu(self.refine(h))
        out: Tensor = self.head(h.mean(dim=(2, 3)))
        return out

    def make_batch(self, generator: torch.Generator, batch_size: int) -> tuple[Tensor, Tensor]:
        x = torch.randn(batch_size, 3, self.image, self.image, generator=generator)
        return x, torch.randint(0, self.classes, (batch_size,), generator=generator)


class EmbeddingModel(_SimModule):
    """Sparse embedding tables (``nn.Embedding(sparse=True)``: sparse gradients) and a dense
    head; branch ``tags`` looks up a second sparse table."""

    branches = ("tags",)

    def __init__(
        self, width: int, vocab: int = 512, tags: int = 64, tokens: int = 8, classes: int = 10
    ) -> None:
        super().__init__()
        self.vocab, self.tag_count, self.tokens, self.classes = vocab, tags, tokens, classes
        self.words = nn.Embedding(vocab, width, sparse=True)
        self.tags = nn.Embedding(tags, width, sparse=True)
        self.hidden = nn.Linear(width, width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: Tensor, active: Sequence[bool] = (True,)) -> Tensor:
        h = self.words(x[:, : self.tokens]).mean(dim=1)
        if active[0]:
            h = h + self.tags(x[:, self.tokens :]).mean(dim=1)
        out: Tensor = self.head(functional.relu(self.hidden(h)))
        return out

    def make_batch(self, generator: torch.Generator, batch_size: int) -> tuple[Tensor, Tensor]:
        words = torch.randint(0, self.vocab, (batch_size, self.tokens), generator=generator)
        tags = torch.randint(0, self.tag_count, (batch_size, 2), generator=generator)
        target = torch.randint(0, self.classes, (batch_size,), generator=generator)
        return torch.cat([words, tags], dim=1), target


class TransformerBlock(_SimModule):
    """A pre-norm transformer block (attention, MLP) over token and position embeddings with a
    next-token head; branch ``adapter`` adds a bottleneck residual MLP."""

    branches = ("adapter",)

    def __init__(self, width: int, vocab: int = 256, seq: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.vocab, self.seq = vocab, seq
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.randn(seq, width) * 0.02)
        self.norm1 = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )
        self.adapter = nn.Sequential(
            nn.Linear(width, width // 4), nn.ReLU(), nn.Linear(width // 4, width)
        )
        self.norm_out = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, x: Tensor, active: Sequence[bool] = (True,)) -> Tensor:
        h = self.embed(x) + self.position
        a = self.norm1(h)
        h = h + self.attention(a, a, a, need_weights=False)[0]
        h = h + self.mlp(self.norm2(h))
        if active[0]:
            h = h + self.adapter(h)
        out: Tensor = self.head(self.norm_out(h))
        return out

    def make_batch(self, generator: torch.Generator, batch_size: int) -> tuple[Tensor, Tensor]:
        tokens = torch.randint(0, self.vocab, (batch_size, self.seq + 1), generator=generator)
        return tokens[:, :-1], tokens[:, 1:]

    def loss(self, output: Tensor, target: Tensor) -> Tensor:
        return functional.cross_entropy(output.reshape(-1, self.vocab), target.reshape(-1))


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """How to build one built-in model; ``default_width`` keeps the default run small."""

    build: Callable[[int], _SimModule]
    default_width: int
    summary: str


MODELS: dict[str, ModelSpec] = {
    "mlp": ModelSpec(MLP, 128, "3 linear layers + 2 optional residual layers"),
    "convnet": ModelSpec(ConvNet, 16, "2 convolutions, batch norm, optional residual conv"),
    "embedding": ModelSpec(EmbeddingModel, 32, "sparse embeddings + dense head"),
    "transformer-block": ModelSpec(TransformerBlock, 64, "one pre-norm transformer block"),
}


# torch's default generator is shared by every thread; rank threads build their models at once,
# so building (seed, draw, restore) holds this lock, or their draws would interleave.
_BUILD_LOCK = threading.Lock()


def build_model(name: str, width: int | None, seed: int) -> _SimModule:
    """The model ``name`` with weights drawn from ``seed``: the same on every call, from any
    thread; the default generator's state is restored afterwards."""
    spec = MODELS[name]
    with _BUILD_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return spec.build(spec.default_width if width is None else width)


def batch_generator(seed: int, rank: int, step: int, micro: int) -> torch.Generator:
    """A generator for one rank's micro-batch: different per rank, reproducible per run."""
    # A string seed is hashed with SHA-512, the same in every process (unlike hash()).
    mixed = random.Random(f"batch:{seed}:{rank}:{step}:{micro}").getrandbits(62)
    return torch.Generator().manual_seed(mixed)


def branch_pattern(
    pattern: str, branches: int, *, seed: int, rank: int, step: int, micro: int
) -> tuple[bool, ...]:
    """Which branches a rank runs in one forward pass.

    - ``none``: every branch, every time.
    - ``random``: each branch with probability 1/2, drawn per rank, step and micro-batch.
    - ``rank-skew``: branch k runs on rank r at step s only when (r + s) % (k + 2) == 0, so
      some ranks always skip a branch, and in small worlds (W <= k + 1) every rank skips it
      at some steps (a parameter unused everywhere keeps its ``.grad``).
    """
    if pattern == "none":
        return (True,) * branches
    if pattern == "random":
        rng = random.Random(f"branches:{seed}:{rank}:{step}:{micro}")
        return tuple(rng.random() < 0.5 for _ in range(branches))
    if pattern == "rank-skew":
        return tuple((rank + step) % (k + 2) == 0 for k in range(branches))
    raise ValueError(f"unknown unused pattern {pattern!r}; choose one of {UNUSED_PATTERNS}")
