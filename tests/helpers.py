"""Helpers the unit tests share: worlds with short timeouts, models, local reference gradients."""

from __future__ import annotations

import itertools
import textwrap
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

import fakepg
import reducer
from reducer.testing.reference import rank_order_average

T = TypeVar("T")
M = TypeVar("M", bound=nn.Module)


def run_ranks(fn: Callable[[fakepg.FakeProcessGroup], T], world_size: int) -> list[T]:
    """fakepg.run with a short timeout, so a test that would hang fails quickly instead."""
    return fakepg.run(fn, world_size, timeout=20.0)


# torch's default generator is shared by every thread: rank threads that seed and build models
# at once would interleave its draws, so building takes this lock. Reentrant checkpointing
# sets and restores that generator's state during backward, outside the lock, so the tests
# that use it on rank threads pass preserve_rng_state=False (their models draw nothing).
_INIT_LOCK = threading.Lock()


def seeded(build: Callable[[], M], seed: int = 0) -> M:
    """``build()`` with the global generator seeded, safe to call from several rank threads."""
    with _INIT_LOCK:
        torch.manual_seed(seed)
        return build()


def mlp(seed: int = 0, widths: tuple[int, ...] = (6, 5, 4, 3)) -> nn.Sequential:
    """The same small MLP on every rank (same seed)."""

    def build() -> nn.Sequential:
        layers: list[nn.Module] = []
        for a, b in itertools.pairwise(widths):
            layers += [nn.Linear(a, b), nn.Tanh()]
        return nn.Sequential(*layers)

    return seeded(build, seed)


def rank_input(rank: int, shape: tuple[int, ...], step: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * step + rank))


def names_of(model: nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters()]


def reducer_for(
    model: nn.Module, pg: reducer.ProcessGroup, cap_mb: float = 1e-4, **kwargs: object
) -> reducer.Reducer:
    """A Reducer over ``model`` with small buckets (several buckets even for a tiny model)."""
    params = list(model.parameters())
    buckets = reducer.ddp_bucket_assignment(params, bucket_cap_mb=cap_mb, first_bucket_mb=cap_mb)
    return reducer.Reducer([params], buckets, pg, param_names=names_of(model), **kwargs)  # type: ignore[arg-type]


def local_grads(
    build: Callable[[], nn.Module], loss_of: Callable[[nn.Module, int], torch.Tensor], rank: int
) -> list[torch.Tensor | None]:
    """The gradients plain autograd gives on ``rank`` (no reducer involved)."""
    model = build()
    loss_of(model, rank).backward()
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def expected_average(
    build: Callable[[], nn.Module],
    loss_of: Callable[[nn.Module, int], torch.Tensor],
    world_size: int,
) -> list[torch.Tensor | None]:
    """Per parameter, the rank-order reference of DESIGN.md from local gradients."""
    per_rank = [local_grads(build, loss_of, r) for r in range(world_size)]
    return [
        rank_order_average([per_rank[r][i] for r in range(world_size)], world_size)
        for i in range(len(per_rank[0]))
    ]


# PowerSGD settings that the differential tests against torch's hook run, one per code path
# (error feedback, QR for rank > 1, batching, no error feedback).
POWERSGD_CONFIGS: dict[str, dict[str, object]] = {
    "rank 1, error feedback, warm start": {"matrix_approximation_rank": 1},
    "rank 3 (QR), no warm start": {
        "matrix_approximation_rank": 3,
        "warm_start": False,
        "min_compression_rate": 0.5,
    },
    "rank 2, batched same shapes": {
        "matrix_approximation_rank": 2,
        "batch_tensors_with_same_shape": True,
        "min_compression_rate": 0.5,
    },
    "rank 1, no error feedback, epsilon": {
        "matrix_approximation_rank": 1,
        "use_error_feedback": False,
        "orthogonalization_epsilon": 1e-8,
    },
}


# -------------------------------------------------------------------------------------------
# Real-model shapes, from small configs: what the differential tests against torch's DDP train.


class _Block(nn.Module):
    """GPT-2's transformer block: pre-norm causal self-attention and a GELU MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(width)
        self.c_attn = nn.Linear(width, 3 * width)
        self.attn_proj = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.c_fc = nn.Linear(width, 4 * width)
        self.mlp_proj = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(width, dim=2)
        q, k, v = (
            t.view(batch, length, self.heads, width // self.heads).transpose(1, 2)
            for t in (q, k, v)
        )
        scores = (q @ k.transpose(-2, -1)) * (1.0 / (width // self.heads) ** 0.5)
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        y = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(batch, length, width)
        x = x + self.attn_proj(y)
        h = nn.functional.gelu(self.c_fc(self.ln_2(x)), approximate="tanh")
        out: torch.Tensor = x + self.mlp_proj(h)
        return out


class TinyGPT2(nn.Module):
    """GPT-2's shape from a small config: token and position embeddings, ``layers`` blocks, a
    final LayerNorm and a language-model head tied to the token embedding (so DDP sees the
    shared weight once). 2 layers: 28 parameters, as GPT-2's 2-layer config."""

    def __init__(
        self, vocab: int = 64, context: int = 16, width: int = 32, heads: int = 4, layers: int = 2
    ) -> None:
        super().__init__()
        self.context = context
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(_Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as GPT-2's

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.lm_head(self.ln_f(x))
        return out


class TinySwitchMoE(nn.Module):
    """A Switch Transformer's MoE layer from a small config: a router picks one expert per
    token (top-1), the expert's output is scaled by the router's probability. With few tokens
    and ``experts`` experts, some experts get no token on some ranks (idle there) and, with
    ``idle_expert``, one is never routed to at all (its router logit is pinned to -inf): the
    model needs ``find_unused_parameters=True``."""

    def __init__(
        self,
        vocab: int = 48,
        width: int = 16,
        experts: int = 6,
        hidden: int = 32,
        layers: int = 2,
        idle_expert: bool = True,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(layers))
        self.routers = nn.ModuleList(nn.Linear(width, experts) for _ in range(layers))
        self.experts = nn.ModuleList(
            nn.ModuleList(
                nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, width))
                for _ in range(experts)
            )
            for _ in range(layers)
        )
        self.idle_expert = idle_expert
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens).reshape(-1, self.embed.embedding_dim)
        for norm, router, experts in zip(self.norms, self.routers, self.experts, strict=True):
            h = norm(x)
            logits = router(h)
            if self.idle_expert:
                logits = torch.cat([logits[:, :-1], torch.full_like(logits[:, -1:], -1e9)], 1)
            probs = logits.softmax(dim=-1)
            gate, choice = probs.max(dim=-1)
            out = torch.zeros_like(h)
            for e, expert in enumerate(experts):
                routed = (choice == e).nonzero().squeeze(1)
                if routed.numel():  # an idle expert is not called: unused this step
                    out = out.index_add(0, routed, expert(h[routed]) * gate[routed, None])
            x = x + out
        logits_out: torch.Tensor = self.head(x)
        return logits_out.view(*tokens.shape, -1)


def tiny_gpt2(seed: int = 0) -> TinyGPT2:
    return seeded(TinyGPT2, seed)


def tiny_switch_moe(seed: int = 0) -> TinySwitchMoE:
    return seeded(TinySwitchMoE, seed)


def token_batch(
    rank: int, step: int, vocab: int, shape: tuple[int, int] = (2, 9)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per rank and step: input tokens and next-token targets (one token longer, split)."""
    generator = torch.Generator().manual_seed(7919 * step + rank)
    tokens = torch.randint(vocab, (shape[0], shape[1] + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def assert_gradients_bit_identical(
    names: Sequence[str],
    ours: Sequence[torch.Tensor | None],
    theirs: Sequence[torch.Tensor | None],
    where: str,
) -> None:
    """Each gradient of ``ours`` is ``theirs``'s bit for bit (None where theirs is None; a
    sparse one compared dense); a failure names the parameter and the largest difference."""
    for name, a, b in zip(names, ours, theirs, strict=True):
        at = f"gradient of {name}, {where}"
        assert (a is None) == (b is None), f"{at}: {a} vs {b}"
        if a is not None and b is not None:
            a, b = (a.to_dense(), b.to_dense()) if a.is_sparse else (a, b)
            assert torch.equal(a, b), (
                f"{at}: not bit-identical (max difference "
                f"{(a.double() - b.double()).abs().max().item():.3g})"
            )


def write_script(tmp_path: Path, name: str, source: str) -> Path:
    """A training script for ``launch``, written from dedented ``source``."""
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def launch_two_ranks(*args: str) -> int:
    """``python -m reducer launch --nproc 2`` in this process, with a 30 s timeout; its exit
    code."""
    from reducer.tools import cli

    return cli.main(["launch", "--nproc", "2", "--timeout", "30", *args])
