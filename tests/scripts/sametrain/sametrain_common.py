"""The training loop the same-training corpus shares: each script in this folder is one known
data-parallel mistake, or its fix, written as the options of :func:`main`.

Run as torchrun runs it (``torchrun --nproc-per-node 2 summed_loss.py --out w.pt``) or under
``python -m reducer launch``. :func:`reference` trains what the script means, as one process on
each step's global batch: the truth the tests compare the ranks' weights with.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import sys
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset, TensorDataset

SAMPLES, FEATURES, CLASSES, BATCH, EPOCHS, LR = 48, 8, 4, 4, 2, 0.1


@dataclass(frozen=True)
class Options:
    """One script's choices (the defaults are a correct script)."""

    model: str = "mlp"  # "mlp", "cnn" (with BatchNorm) or "kwargs" (HF-shaped: called with
    # keyword arguments, the loss computed inside, returned in a dict)
    batchnorm: str = "frozen"  # the CNN's BatchNorm: "frozen" (eval, as when fine-tuning),
    # "train" (statistics of each rank's batch) or "sync" (SyncBatchNorm: GPU only)
    dropout: float = 0.0
    seed_per_rank: bool = True  # torch.manual_seed(seed + rank) after building the model
    augment: bool = False  # a random sign flip of each sample when fetched
    sampler: str = "distributed"  # "distributed", "none", "one-replica", "split", "overlap",
    # "join" (a split whose last rank has one batch fewer, trained under DDP's join())
    set_epoch: bool = True
    uneven: bool = False  # hand-rolled shards of unequal size, batches in proportion
    reduction: str = "mean"
    accumulation: int = 2
    divide: int = 1  # how many times the loss is divided by the accumulation steps
    deliberate: tuple[str, ...] = ()
    amp: bool = False  # a GradScaler scales the loss and unscales the gradients
    samples: int = SAMPLES  # fewer: a DistributedSampler pads them to a multiple of the ranks


class KwargsModel(nn.Module):
    """HF-shaped: ``model(input=x, labels=y)["loss"]``."""

    def __init__(self, net: nn.Module, reduction: str) -> None:
        super().__init__()
        self.net, self.reduction = net, reduction

    def forward(self, input: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.net(input)
        return {"loss": F.cross_entropy(logits, labels, reduction=self.reduction)}


class Flip(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A dataset whose samples are augmented with torch's generator when fetched."""

    def __init__(self, base: TensorDataset) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.base[i]
        return (x if torch.rand(()) < 0.5 else -x), y


def dataset(model: str, samples: int = SAMPLES) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    shape = (samples, 2, 4, 4) if model == "cnn" else (samples, FEATURES)
    return TensorDataset(torch.randn(shape, generator=g), torch.arange(samples) % CLASSES)


def build(opts: Options) -> nn.Module:
    torch.manual_seed(0)
    if opts.model in ("mlp", "kwargs"):
        net = nn.Sequential(
            nn.Linear(FEATURES, 16), nn.Tanh(), nn.Dropout(opts.dropout), nn.Linear(16, CLASSES)
        )
        return net if opts.model == "mlp" else KwargsModel(net, opts.reduction)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(64, CLASSES),
    )


def freeze(model: nn.Module, opts: Options) -> None:
    """A frozen BatchNorm normalises with its running statistics (eval mode)."""
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and opts.batchnorm == "frozen":
            module.eval()


def shard_sizes(world: int) -> list[int]:
    """Per-rank batch sizes of the uneven split (every rank runs as many batches)."""
    sizes = [2] * (world - 1)
    return [*sizes, 2 * BATCH - sum(sizes)] if world <= 3 else [BATCH] * world


def loader(opts: Options, data: Dataset[Any], rank: int, world: int) -> DataLoader[Any]:
    if opts.uneven:
        sizes = shard_sizes(world)
        per_batch = SAMPLES // sum(sizes)
        start = sum(sizes[:rank]) * per_batch
        part = Subset(data, list(range(start, start + sizes[rank] * per_batch)))
        return DataLoader(part, batch_size=sizes[rank])
    if opts.sampler == "distributed":
        return DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, seed=0))
    if opts.sampler == "one-replica":
        sampler = DistributedSampler(data, num_replicas=1, rank=0, seed=0)
        return DataLoader(data, batch_size=BATCH, sampler=sampler)
    if opts.sampler in ("split", "join"):
        indices = list(range(rank, SAMPLES, world))
        if opts.sampler == "join" and rank == world - 1:
            indices = indices[:-BATCH]
        return DataLoader(Subset(data, indices), batch_size=BATCH)
    if opts.sampler == "overlap":  # consecutive windows that share their edges
        size = SAMPLES // world
        start = max(0, rank * size - BATCH)
        return DataLoader(Subset(data, list(range(start, start + size))), batch_size=BATCH)
    return DataLoader(data, batch_size=BATCH, shuffle=False)


def train(opts: Options, rank: int, world: int) -> nn.Module:
    """The script's training, on this rank (world 1: one process, no wrapper)."""
    import reducer.testing.sametrain

    if opts.deliberate:
        reducer.testing.sametrain.deliberate(*opts.deliberate)
    model = build(opts)
    if world > 1 and opts.model == "cnn" and opts.batchnorm == "sync":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    freeze(model, opts)
    torch.manual_seed(100 + rank if opts.seed_per_rank else 100)
    raw = model
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    base = dataset(opts.model, opts.samples)
    data: Dataset[Any] = Flip(base) if opts.augment else base
    batches = loader(opts, data, rank, world)
    optimizer = torch.optim.SGD(raw.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", enabled=opts.amp)
    joining = model.join() if opts.sampler == "join" else contextlib.nullcontext()
    with joining:
        _epochs(opts, model, batches, optimizer, scaler)
    return raw


def _epochs(opts: Options, model: nn.Module, batches: Any, optimizer: Any, scaler: Any) -> None:
    micro = 0
    for epoch in range(EPOCHS):
        sampler = batches.sampler
        if opts.set_epoch and isinstance(sampler, DistributedSampler):
            sampler.set_epoch(epoch)
        for x, y in batches:
            if opts.model == "kwargs":
                loss = model(input=x, labels=y)["loss"]
            else:
                loss = F.cross_entropy(model(x), y, reduction=opts.reduction)
            for _ in range(opts.divide):
                loss = loss / opts.accumulation
            scaler.scale(loss).backward()
            micro += 1
            if micro % opts.accumulation == 0:
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()


def main(opts: Options) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="rank 0 saves its weights here")
    args = parser.parse_args()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(100 + rank if opts.seed_per_rank else 100)
    print(f"generator {hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()[:12]}")
    model = train(opts, rank, world)
    if rank == 0 and args.out:
        torch.save([p.detach().clone() for p in model.parameters()], args.out)
    if world > 1:
        dist.barrier()  # every rank ends together: gloo's teardown of a peer that left early
        # The weights are saved: leave without running gloo's teardown, whose threads can
        # abort a loaded machine's process at exit ("terminate called without an active
        # exception") after every result is written.
        sys.stdout.flush()
        os._exit(0)


def reference(opts: Options, world: int) -> list[torch.Tensor]:
    """What the script means, as one process: each optimizer step on the global batch (every
    rank's micro-batches of the step, read as a correct DistributedSampler or the script's own
    disjoint split would give them, each sample once per epoch), a mean loss, BatchNorm over
    the global batch, no dropout or augmentation."""
    model = build(replace(opts, dropout=0.0, reduction="mean"))
    freeze(model, opts)
    base = dataset(opts.model, opts.samples)
    data = TensorDataset(*base.tensors, torch.arange(opts.samples))  # samples know their index
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    fixed = replace(
        opts,
        sampler=opts.sampler if opts.sampler in ("split", "join") else "distributed",
        set_epoch=True,
        augment=False,
    )
    samplers = []
    for rank in range(world):
        if fixed.uneven or fixed.sampler in ("split", "join"):
            samplers.append(loader(fixed, data, rank, world))
        else:
            sampler = DistributedSampler(data, num_replicas=world, rank=rank, seed=0)
            samplers.append(DataLoader(data, batch_size=BATCH, sampler=sampler))
    for epoch in range(EPOCHS):
        for each in samplers:
            if isinstance(each.sampler, DistributedSampler):
                each.sampler.set_epoch(epoch)
        per_rank = [list(each) for each in samplers]
        count = max(len(batches) for batches in per_rank)
        seen: set[int] = set()
        for start in range(0, count, opts.accumulation):
            group = [b for batches in per_rank for b in batches[start : start + opts.accumulation]]
            index = torch.cat([b[2] for b in group])
            once = torch.tensor([int(i) not in seen for i in index])  # a padded sample: once
            seen.update(int(i) for i in index)
            x = torch.cat([b[0] for b in group])[once]
            y = torch.cat([b[1] for b in group])[once]
            if opts.model == "kwargs":
                model(input=x, labels=y)["loss"].backward()
            else:
                F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    return [p.detach() for p in model.parameters()]
