"""Training-step time of this reducer against torch's DistributedDataParallel on one GPU.

One rank, NCCL (world size 1, so the allreduce itself is nearly free and what remains is each
wrapper's own work). Per model, five variants run interleaved step by step: plain (no
wrapper, the floor); this reducer over ``reducer.TorchProcessGroup``, copying gradients into
buckets (``reducer``) and with ``gradient_as_bucket_view`` (``reducer views``); and torch's
DDP with the same two settings (bucket cap 25 MiB). A step is forward and loss under bf16
autocast, then backward with the reducer's prepare_for_backward and finalize, timed on the
GPU with CUDA events from before the forward to after backward returns: the GPU's idle time
while Python issues work counts. GPU kernels take microseconds, so this is where a Python hook
per parameter costs most. Models: the two of ``reducer_overhead.py`` (8 x Linear(1024), 400
small parameters) and a transformer of ``--layers`` layers (24: 294 parameters).

    python benchmarks/gpu_overhead.py [--steps 40] [--warmup 10] [--bucket-cap-mb 25]
        [--layers 24]

Without a CUDA GPU or without NCCL it says why and exits 0.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Variant, interleave, median_ms, paired_ratio, reducer_and_torch_ddp, table
from models import MODELS, batch, with_copies

import reducer

# Each reducer variant's row compares it with torch's DDP with the same settings.
VERSUS = {"reducer": "torch DDP", "reducer views": "torch DDP views"}
HEADERS = [
    "model",
    "variant",
    "step ms",
    "overhead % (vs plain)",
    "vs torch DDP (same settings)",
    "median per-step ratio",
]


class Transformer(nn.Module):
    """GPT-style: token and position embeddings, ``layers`` pre-norm encoder layers (width
    512, 8 heads, MLP 2048, no dropout), a final norm and the vocabulary head."""

    def __init__(self, layers: int = 24, width: int = 512, vocab: int = 8192, seq: int = 256):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(seq, width))
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                width, 8, 4 * width, dropout=0.0, batch_first=True, norm_first=True
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed(tokens) + self.position
        for block in self.blocks:
            h = block(h)
        out: Tensor = self.head(self.norm(h))
        return out


def tokens(batch_size: int = 8, seq: int = 256, vocab: int = 8192) -> Tensor:
    return torch.randint(0, vocab, (batch_size, seq), generator=torch.Generator().manual_seed(0))


# name -> (build, the input on the CPU)
Model = tuple[Callable[[], nn.Module], Callable[[int], Tensor]]


def gpu_models(layers: int = 24) -> dict[str, Model]:
    models: dict[str, Model] = {
        name: (build, lambda size, width=width: batch(width, size))
        for name, (build, width) in MODELS.items()
    }
    models[f"{layers}-layer transformer (width 512, batch 8 x 256 tokens)"] = (
        lambda: Transformer(layers=layers),
        lambda _size: tokens(),
    )
    return models


def skip_reason() -> str | None:
    """Why this cannot run here, or None."""
    if torch.version.cuda is None:
        return f"this torch build ({torch.__version__}) has no CUDA"
    if not torch.cuda.is_available():
        return "no GPU visible (torch.cuda.is_available() is False)"
    if not dist.is_nccl_available():
        return "this torch build has no NCCL"
    return None


def measure(
    name: str, model: Model, args: argparse.Namespace, device: torch.device
) -> list[list[object]]:
    build, make_input = model
    base, copy_of = with_copies(build)
    base.to(device)
    x = make_input(args.batch).to(device)
    pg = reducer.TorchProcessGroup(dist.group.WORLD)  # type: ignore[arg-type]
    variants, reducers = reducer_and_torch_ddp(
        base, lambda: copy_of().to(device), pg, args.bucket_cap_mb, plain="plain"
    )
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)

    def step(_step: int, variant: Variant) -> float:
        module, forward, prepare = variant
        torch.cuda.synchronize()  # the step starts on an idle GPU
        start.record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = forward(x).float().sum()
        prepare()
        loss.backward()
        end.record()
        end.synchronize()
        module.zero_grad(set_to_none=False)
        return start.elapsed_time(end) / 1e3  # ms -> s

    samples = interleave(variants, args.steps, args.warmup, step)
    for red in reducers:
        red.close()
    med = {label: median_ms(s) for label, s in samples.items()}
    count = sum(1 for _ in base.parameters())
    rows: list[list[object]] = []
    for label in variants:
        versus = paired = ""
        if label in VERSUS:
            versus = f"{med[label] / med[VERSUS[label]]:.2f}x"
            paired = paired_ratio(samples[label], samples[VERSUS[label]])
        overhead = 100 * (med[label] - med["plain"]) / med["plain"]
        title = f"{name}, {count} params" if not rows else ""
        rows.append([title, label, med[label], overhead, versus, paired])
    return rows


def ratios(rows: list[list[object]]) -> str:
    """One line: per model, the reducer's median per-step ratio to torch's DDP (copies, then
    views), the figure to hold against 1.2x."""
    parts = []
    model = ""
    for row in rows:
        model = str(row[0]).rsplit(", ", 1)[0] if row[0] else model
        if row[1] == "reducer":
            parts.append(f"{model}: {row[5]}")
        elif row[1] == "reducer views":
            parts[-1] += f" (views {row[5]})"
    return "reducer against torch DDP, median per-step ratio: " + "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="timed steps per variant (40)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first (10)")
    parser.add_argument("--batch", type=int, default=32, help="batch of the two MLPs (32)")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument("--layers", type=int, default=24, help="the transformer's layers (24)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    reason = skip_reason()
    if reason is not None:
        print(f"gpu_overhead: skipped: {reason}")
        return 0
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl",
        rank=0,
        world_size=1,
        store=dist.HashStore(),  # type: ignore[attr-defined]
        device_id=device,
    )
    try:
        print(
            f"# step time on one GPU: NCCL, world size 1, bf16 autocast, forward + backward, "
            f"CUDA events; median of {args.steps} steps after {args.warmup} warm-up"
        )
        nccl = torch.cuda.nccl.version()  # a tuple in recent torch, an int in older ones
        nccl_text = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        print(
            f"# device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}, NCCL {nccl_text}\n"
        )
        rows = [
            row
            for name, model in gpu_models(args.layers).items()
            for row in measure(name, model, args, device)
        ]
        print(table(HEADERS, rows))
        print(f"\n{ratios(rows)}")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
