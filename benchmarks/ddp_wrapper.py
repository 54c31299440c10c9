"""Step time of reducer.DistributedDataParallel against torch's DDP, option by option, 2 gloo ranks.

Two processes on this machine (gloo over loopback) train the models of ``models.py``. Per
model, the variants run interleaved step by step, so that drift and noise affect all alike:
the bare ``reducer.Reducer`` (the anchor: what the wrapper adds is the difference), then this
wrapper and torch's DDP with the same settings: default, ``gradient_as_bucket_view``,
``find_unused_parameters``, ``static_graph``, and the fp16 compression comm hook. Both
wrappers rebuild their buckets after the first step (inside the warmup). A step is zero_grad
(set_to_none=False), forward, loss and backward, including the wait for every allreduce; the
ranks meet at an untimed barrier before each step. Each rank uses cores / 2 intra-op threads.
Rank 0 reports medians and, per option, the median of the per-step ratios of this wrapper to
torch's DDP (paired steps, less noisy than the ratio of medians).

    python benchmarks/ddp_wrapper.py [--steps 40] [--batch 32] [--bucket-cap-mb 25] [--threads N]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _gloo
from _common import Variant, median_ms, paired_ratio
from models import MODELS, batch, with_copies

import reducer

ANCHOR = "bare Reducer (anchor)"
# option label -> keyword arguments for both wrappers, and whether to register the fp16 hook
OPTIONS: dict[str, tuple[dict[str, bool], bool]] = {
    "default": ({}, False),
    "gradient_as_bucket_view": ({"gradient_as_bucket_view": True}, False),
    "find_unused_parameters": ({"find_unused_parameters": True}, False),
    "static_graph": ({"static_graph": True}, False),
    "fp16_compress_hook": ({}, True),
}


def measure(name: str, args: argparse.Namespace, rank: int) -> list[list[object]]:
    build, width = MODELS[name]
    _, copy_of = with_copies(build)
    x = batch(width, args.batch, seed=rank)
    pg = reducer.TorchProcessGroup(dist.group.WORLD)  # type: ignore[arg-type]

    variants: dict[str, Variant] = {}
    anchor = copy_of()
    params = list(anchor.parameters())
    bare = reducer.Reducer(
        [params], reducer.ddp_bucket_assignment(params, bucket_cap_mb=args.bucket_cap_mb), pg
    )
    variants[ANCHOR] = (anchor, anchor, lambda: bare.prepare_for_backward([]))
    ours_of: dict[str, str] = {}
    for option, (kwargs, fp16) in OPTIONS.items():
        ours_model, theirs_model = copy_of(), copy_of()
        ours = reducer.DistributedDataParallel(
            ours_model, pg, bucket_cap_mb=args.bucket_cap_mb, **kwargs
        )
        theirs = nn.parallel.DistributedDataParallel(
            theirs_model, bucket_cap_mb=args.bucket_cap_mb, **kwargs
        )
        if fp16:
            ours.register_comm_hook(None, reducer.fp16_compress_hook)
            theirs.register_comm_hook(None, default_hooks.fp16_compress_hook)
        variants[f"this DDP, {option}"] = (ours_model, ours, lambda: None)
        variants[f"torch DDP, {option}"] = (theirs_model, theirs, lambda: None)
        ours_of[f"this DDP, {option}"] = f"torch DDP, {option}"

    samples = _gloo.time_training_steps(variants, x, args.steps)
    bare.close()

    anchor_ms = median_ms(samples[ANCHOR])
    rows: list[list[object]] = []
    for label in variants:
        paired = paired_ratio(samples[label], samples[ours_of[label]]) if label in ours_of else ""
        med = median_ms(samples[label])
        rows.append([name if not rows else "", label, med, f"{med / anchor_ms:.2f}x", paired])
    return rows


def main(argv: list[str] | None = None) -> None:
    headers = ["model", "variant", "step ms", "vs anchor", "this / torch (paired)"]
    description = __doc__.split("\n\n")[0]
    _gloo.compare_training_steps("ddp_wrapper", description, measure, headers, steps=40, argv=argv)


if __name__ == "__main__":
    main()
