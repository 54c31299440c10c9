"""Real models by shape alone, for predicting a cluster: ResNet50, BERT, GPT-2.

Each is written out here layer by layer (no torchvision, no transformers, no weights, no
download), with the parameter shapes and order of its reference definition, so that DDP
buckets them as it would the real model and the FLOPs of its forward and backward can be
counted. Build them on the meta device (``with torch.device("meta")``): no memory is used.

- ``resnet50``: torchvision's ``resnet50()`` (He et al. 2016, v1.5: stride on the 3x3 conv),
  161 tensors, 25,557,032 parameters; batches of 224 x 224 images, 1000 classes.
- ``bert-base`` / ``bert-large``: Hugging Face's ``BertModel`` (with the pooler) and a
  classification head over the pooled output: 12 layers x 768 (199 + 2 tensors,
  109,482,240 + 1,538 parameters) and 24 x 1024 (391 + 2 tensors, 335,141,888 + 2,050).
  Sequences of 128 tokens.
- ``gpt2``, ``gpt2-medium``, ``gpt2-large``, ``gpt2-xl``: Hugging Face's ``GPT2Model``
  with the language-model head tied to the token embedding (124,439,808 / 354,823,168 /
  774,030,080 / 1,557,611,200 parameters). Sequences of 1024 tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional

__all__: list[str] = []


# -------------------------------------------------------------------------------------------
# ResNet50, as torchvision.models.resnet50 defines it.


class _Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int, downsample: bool) -> None:
        super().__init__()
        width = planes
        self.conv1 = nn.Conv2d(inplanes, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.downsample = (
            nn.Sequential(
                nn.Conv2d(inplanes, planes * 4, 1, stride=stride, bias=False),
                nn.BatchNorm2d(planes * 4),
            )
            if downsample
            else None
        )

    def forward(self, x: Tensor) -> Tensor:
        out = functional.relu(self.bn1(self.conv1(x)))
        out = functional.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.downsample is None else self.downsample(x)
        return functional.relu(out + identity)


class ResNet50(nn.Module):
    """torchvision's ResNet50: stem, four stages of 3, 4, 6, 3 bottlenecks, pooled head."""

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        inplanes = 64
        for index, (planes, blocks, stride) in enumerate(
            [(64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)], start=1
        ):
            layers = []
            for b in range(blocks):
                layers.append(
                    _Bottleneck(inplanes, planes, stride if b == 0 else 1, downsample=b == 0)
                )
                inplanes = planes * 4
            setattr(self, f"layer{index}", nn.Sequential(*layers))
        self.fc = nn.Linear(2048, classes)
        self.classes = classes

    def forward(self, x: Tensor) -> Tensor:
        x = functional.relu(self.bn1(self.conv1(x)))
        x = functional.max_pool2d(x, 3, stride=2, padding=1)
        for index in range(1, 5):
            x = getattr(self, f"layer{index}")(x)
        out: Tensor = self.fc(torch.flatten(functional.adaptive_avg_pool2d(x, 1), 1))
        return out

    def make_batch(self, batch_size: int, device: torch.device) -> tuple[Tensor, Tensor]:
        x = torch.empty(batch_size, 3, 224, 224, device=device)
        return x, torch.zeros(batch_size, dtype=torch.int64, device=device)

    def loss(self, output: Tensor, target: Tensor) -> Tensor:
        return functional.cross_entropy(output, target)


# -------------------------------------------------------------------------------------------
# Transformers: BERT (post-norm encoder) and GPT-2 (pre-norm decoder).


class _SelfAttention(nn.Module):
    """Multi-head attention as Hugging Face's BERT lays its weights out (q, k, v, output)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.output = nn.Linear(hidden, hidden)

    def forward(self, x: Tensor) -> Tensor:
        b, t, h = x.shape

        def split(y: Tensor) -> Tensor:
            return y.view(b, t, self.heads, h // self.heads).transpose(1, 2)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        scores = functional.softmax(q @ k.transpose(-2, -1) / (h // self.heads) ** 0.5, dim=-1)
        out: Tensor = self.output((scores @ v).transpose(1, 2).reshape(b, t, h))
        return out


class _BertLayer(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.attention = _SelfAttention(hidden, heads)
        self.attention_norm = nn.LayerNorm(hidden)
        self.intermediate = nn.Linear(hidden, 4 * hidden)
        self.out = nn.Linear(4 * hidden, hidden)
        self.out_norm = nn.LayerNorm(hidden)

    def forward(self, x: Tensor) -> Tensor:
        x = self.attention_norm(x + self.attention(x))
        out: Tensor = self.out_norm(x + self.out(functional.gelu(self.intermediate(x))))
        return out


class Bert(nn.Module):
    """BertModel (embeddings, encoder, pooler) with a 2-class head on the pooled output."""

    def __init__(self, layers: int, hidden: int, heads: int, seq: int = 128) -> None:
        super().__init__()
        self.seq = seq
        self.word = nn.Embedding(30522, hidden)
        self.position = nn.Embedding(512, hidden)
        self.token_type = nn.Embedding(2, hidden)
        self.embedding_norm = nn.LayerNorm(hidden)
        self.layers = nn.ModuleList(_BertLayer(hidden, heads) for _ in range(layers))
        self.pooler = nn.Linear(hidden, hidden)
        self.classifier = nn.Linear(hidden, 2)

    def forward(self, tokens: Tensor) -> Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.word(tokens) + self.position(positions) + self.token_type(tokens * 0)
        x = self.embedding_norm(x)
        for layer in self.layers:
            x = layer(x)
        out: Tensor = self.classifier(torch.tanh(self.pooler(x[:, 0])))
        return out

    def make_batch(self, batch_size: int, device: torch.device) -> tuple[Tensor, Tensor]:
        tokens = torch.zeros(batch_size, self.seq, dtype=torch.int64, device=device)
        return tokens, torch.zeros(batch_size, dtype=torch.int64, device=device)

    def loss(self, output: Tensor, target: Tensor) -> Tensor:
        return functional.cross_entropy(output, target)


class _Gpt2Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(hidden)
        self.c_attn = nn.Linear(hidden, 3 * hidden)  # Conv1D in HF: the same shapes' numel
        self.c_proj = nn.Linear(hidden, hidden)
        self.ln_2 = nn.LayerNorm(hidden)
        self.c_fc = nn.Linear(hidden, 4 * hidden)
        self.mlp_proj = nn.Linear(4 * hidden, hidden)

    def forward(self, x: Tensor) -> Tensor:
        b, t, h = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(h, dim=2)
        q, k, v = (y.view(b, t, self.heads, h // self.heads).transpose(1, 2) for y in (q, k, v))
        attended = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(attended.transpose(1, 2).reshape(b, t, h))
        out: Tensor = x + self.mlp_proj(functional.gelu(self.c_fc(self.ln_2(x))))
        return out


class Gpt2(nn.Module):
    """GPT2Model with the language-model head tied to the token embedding."""

    def __init__(self, layers: int, hidden: int, heads: int, seq: int = 1024) -> None:
        super().__init__()
        self.seq = seq
        self.wte = nn.Embedding(50257, hidden)
        self.wpe = nn.Embedding(1024, hidden)
        self.h = nn.ModuleList(_Gpt2Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)

    def forward(self, tokens: Tensor) -> Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        out: Tensor = self.ln_f(x) @ self.wte.weight.t()  # the tied head
        return out

    def make_batch(self, batch_size: int, device: torch.device) -> tuple[Tensor, Tensor]:
        tokens = torch.zeros(batch_size, self.seq, dtype=torch.int64, device=device)
        return tokens, tokens

    def loss(self, output: Tensor, target: Tensor) -> Tensor:
        return functional.cross_entropy(output.flatten(0, 1), target.flatten())


@dataclass(frozen=True, slots=True)
class ShapeModel:
    """How to build one model by shape, and the batch size its published runs used.
    ``build()`` makes it; for a model of sequences, ``build(seq_len)`` makes it for sequences
    of that length (``seq_len``: the default, up to ``max_seq_len``: its position table)."""

    build: Callable[..., nn.Module]
    batch_size: int
    summary: str
    seq_len: int | None = None
    max_seq_len: int | None = None


def _bert(layers: int, hidden: int, heads: int, batch: int, name: str) -> ShapeModel:
    """BERT for sequences of 128 tokens by default, up to its 512 positions."""
    build = lambda seq=128: Bert(layers, hidden, heads, seq)  # noqa: E731
    return ShapeModel(build, batch, f"{name}, 128 tokens", 128, 512)


def _gpt2(layers: int, hidden: int, heads: int, batch: int, name: str) -> ShapeModel:
    """GPT-2 for sequences of its 1024 positions by default."""
    build = lambda seq=1024: Gpt2(layers, hidden, heads, seq)  # noqa: E731
    return ShapeModel(build, batch, f"{name}, 1024 tokens", 1024, 1024)


SHAPE_MODELS: dict[str, ShapeModel] = {
    "resnet50": ShapeModel(ResNet50, 32, "torchvision ResNet50, 224x224 images"),
    "bert-base": _bert(12, 768, 12, 32, "BERT-base"),
    "bert-large": _bert(24, 1024, 16, 16, "BERT-large"),
    "gpt2": _gpt2(12, 768, 12, 8, "GPT-2 124M"),
    "gpt2-medium": _gpt2(24, 1024, 16, 8, "GPT-2 355M"),
    "gpt2-large": _gpt2(36, 1280, 20, 4, "GPT-2 774M"),
    "gpt2-xl": _gpt2(48, 1600, 25, 2, "GPT-2 1.5B"),
}


def build(
    name: str, device: torch.device | str = "meta", *, seq_len: int | None = None
) -> nn.Module:
    """The model ``name`` on ``device`` (meta by default: shapes only), for sequences of
    ``seq_len`` tokens (None: the model's own; only for a model of sequences)."""
    if name not in SHAPE_MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(SHAPE_MODELS)}")
    entry = SHAPE_MODELS[name]
    if seq_len is not None:
        if entry.seq_len is None:
            raise ValueError(f"--seq-len: {name} reads no sequences ({entry.summary})")
        limit = entry.max_seq_len or entry.seq_len
        if not 1 <= seq_len <= limit:
            raise ValueError(
                f"--seq-len: {name} takes sequences of 1 to {limit} tokens (its position "
                f"table), got {seq_len}"
            )
    with torch.device(device):
        return entry.build() if seq_len is None else entry.build(seq_len)
