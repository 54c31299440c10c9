"""``python -m reducer simulate --predict``: a step on a real cluster, predicted, as a table.

Reads the prediction's options from the simulate command line, runs
:func:`reducer.tools.simulate.cluster.predict` once per bucket cap (``--bucket-cap-mb``, or
each of ``--sweep-bucket-cap``), and prints what it assumed (batch, sequence length, dtype,
optimizer, world, network, compute: every input the prediction did not measure, with the flag
that changes it) and one row per cap. ``--json PATH`` (``-``: stdout) writes the same as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

import fakepg
from reducer.tools.whatif import cap_label, cap_order, parse_caps

from . import cluster, gpu, report, shapes
from .records import world_size_of

__all__: list[str] = []


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--predict",
        action="store_true",
        help="predict one step on a real cluster instead of running the ranks: one rank of "
        "a model by shape (" + ", ".join(shapes.SHAPE_MODELS) + ") through the real DDP "
        "reducer, the other ranks identical, --network costing the collectives",
    )
    add(
        "--gpu",
        default="v100",
        help="with --predict: estimate compute for this GPU "
        f"({', '.join(gpu.GPUS)}; default v100) from each kernel's FLOPs and bytes",
    )
    add(
        "--profile",
        default=None,
        metavar="FILE",
        help="with --predict: compute measured where the job runs (this project's JSON: "
        "per-parameter gradient-ready times, forward and optimizer time; or torch.profiler's "
        "Chrome trace of a few steps of the model), instead of the estimate",
    )
    add(
        "--save-profile",
        default=None,
        metavar="FILE",
        help="with --predict --device cuda: write the measured profile there",
    )
    add(
        "--overlap",
        choices=("on", "off"),
        default="on",
        help="with --predict: off starts no collective before backward ends (default on)",
    )
    add(
        "--shared-cores",
        action="store_true",
        help="with --predict: collectives run on the cores that compute (gloo on CPU "
        "tensors, one core per rank), so none overlaps compute",
    )
    add(
        "--host-call-us",
        type=float,
        default=0.0,
        metavar="US",
        help="with --predict --shared-cores: the host's cost of one collective call in "
        "microseconds (the reducer's work per bucket and the process group's call), measured "
        "where the job runs; paid on the cores that compute (default 0)",
    )
    add(
        "--host-hook-us",
        type=float,
        default=0.0,
        metavar="US",
        help="with --predict --shared-cores: the reducer's host cost per gradient hook in "
        "microseconds, measured where the job runs; paid on the cores that compute (default 0)",
    )
    add(
        "--process-groups",
        type=int,
        default=1,
        metavar="K",
        help="with --predict: deal buckets round robin to K process groups (default 1)",
    )
    add(
        "--dtype",
        choices=list(cluster.PREDICTED_DTYPES),
        default="float32",
        help="with --predict: the parameters', gradients' and buckets' dtype (default float32)",
    )
    add(
        "--seq-len",
        type=int,
        default=None,
        metavar="TOKENS",
        help="with --predict: tokens per sequence of a transformer (default: the model's own, "
        "128 for BERT, 1024 for GPT-2)",
    )
    add(
        "--json",
        default=None,
        metavar="PATH",
        help="with --predict: also write the assumptions and the predictions as JSON to PATH "
        "('-': stdout, the table then going to stderr)",
    )


def wants_prediction(args: argparse.Namespace) -> bool:
    return bool(args.predict) or args.model in shapes.SHAPE_MODELS


def run(args: argparse.Namespace) -> int:
    """Predict and print; 2 on bad arguments."""
    try:
        configs, notes = _configs(args)
    except ValueError as exc:
        print(f"simulate: {exc}", file=sys.stderr)
        return 2
    to_stdout = args.json == "-"
    console = Console(stderr=True, highlight=False, width=120) if to_stdout else report.console()
    start = time.perf_counter()
    try:
        predictions = [cluster.predict(c) for c in configs]
    except ValueError as exc:
        print(f"simulate: {exc}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - start
    if args.trace is not None:
        try:
            count = write_trace(args.trace, predictions[0])
            notes.append(f"trace: {count} events of the first cap's step written to {args.trace}")
        except OSError as exc:
            notes.append(f"trace: could not write {args.trace}: {exc}")
    assumed = assumptions(configs[0], args)
    wrote = True
    if args.json is not None:
        text = json.dumps(as_json(assumed, predictions, notes), indent=2)
        if to_stdout:
            print(text)
        else:
            try:
                with open(args.json, "w") as out:
                    out.write(text + "\n")
                notes.append(f"json: written to {args.json}")
            except OSError as exc:
                notes.append(f"json: could not write {args.json}: {exc}")
                wrote = False
    _print(console, configs[0], predictions, notes, elapsed, assumed)
    return 0 if wrote else 1


# -------------------------------------------------------------------------------------------
# What the prediction assumed.


@dataclass(frozen=True, slots=True)
class Assumption:
    """One input of the prediction it did not measure: its name, value (as JSON holds it),
    the words that show it, and the flag that changes it."""

    key: str
    value: Any
    text: str
    flag: str = ""
    printed: bool = True  # False: the table's header already shows it


def assumptions(config: cluster.ClusterConfig, args: argparse.Namespace) -> list[Assumption]:
    """Every input of ``config``'s prediction that was assumed rather than measured."""
    entry = shapes.SHAPE_MODELS[config.model]
    net = shapes.build(config.model, seq_len=config.seq_len)
    params = [p for p in net.parameters() if p.requires_grad]
    count = sum(p.numel() for p in params)
    batch = config.batch_size or (config.profile.batch_size if config.profile else entry.batch_size)
    seq = getattr(net, "seq", None)
    per_step = batch * config.no_sync_every * config.world_size
    network = config.network
    topology = getattr(network, "topology", None)
    nodes = topology.nodes(config.world_size) if topology is not None else None
    dtype = str(config.dtype).removeprefix("torch.")
    gpu = config.gpu
    compute = (
        f"profile measured on {config.profile.device}"
        if config.profile is not None
        else f"ESTIMATE for {gpu.name} from each kernel's FLOPs and bytes"  # type: ignore[union-attr]
    )
    world = f"{config.world_size} ranks"
    if topology is not None:
        world += f": {nodes} node(s) of up to {topology.gpus_per_node} GPUs"
    out = [
        Assumption(
            "model",
            config.model,
            f"{config.model}: {entry.summary}, {count:,} parameters in {len(params)} tensors",
            "--model",
        ),
        Assumption(
            "batch_size",
            batch,
            f"{batch} samples per rank per micro-batch; "
            f"{per_step} per optimizer step over every rank",
            "--batch-size",
        ),
        Assumption(
            "seq_len",
            seq,
            f"{seq} tokens per sequence" if seq is not None else "none: images (224 x 224)",
            "--seq-len" if seq is not None else "",
        ),
        Assumption("dtype", dtype, f"{dtype} parameters, gradients and buckets", "--dtype"),
        Assumption(
            "optimizer",
            "SGD(momentum=0.9)",
            "SGD with momentum 0.9, one step per optimizer step of the model's parameters",
        ),
        Assumption("loss", "cross_entropy", "cross-entropy"),
        Assumption("world_size", config.world_size, world, "--world-size"),
        Assumption("nodes", nodes, str(nodes), printed=False),
        Assumption(
            "network",
            _network_json(network),
            "none (memory speed)" if network is None else str(network),
            "--network",
            printed=False,
        ),
        Assumption("compute", _compute_json(config), compute, "--gpu, --profile", printed=False),
        Assumption(
            "overlap", config.overlap, "on" if config.overlap else "off", "--overlap", printed=False
        ),
        Assumption(
            "no_sync_every",
            config.no_sync_every,
            f"{config.no_sync_every} micro-batch(es) per optimizer step, the last one synced",
            "--no-sync-every",
        ),
        Assumption(
            "process_groups",
            config.process_groups,
            str(config.process_groups),
            "--process-groups",
            printed=False,
        ),
        Assumption(
            "step",
            "third",
            "the third step: steady, after DDP rebuilt its buckets in "
            "gradient-ready order at the end of the first",
        ),
    ]
    if config.shared_cores:
        out.append(
            Assumption(
                "shared_cores",
                {"host_call_us": args.host_call_us, "host_hook_us": args.host_hook_us},
                "collectives on the cores that compute (gloo on CPU tensors)",
                "--shared-cores",
            )
        )
    return out


def _network_json(network: object) -> Any:
    if network is None:
        return None
    if isinstance(network, fakepg.NcclModel | fakepg.GlooModel):
        return fakepg.cluster_to_dict(network)
    fields = getattr(network, "__dataclass_fields__", {})
    return {"model": type(network).__name__, "text": str(network),
            **{k: getattr(network, k) for k in fields}}  # fmt: skip


def _compute_json(config: cluster.ClusterConfig) -> dict[str, Any]:
    if config.profile is not None:
        return {"source": "profile", "device": config.profile.device}
    spec = config.gpu
    assert spec is not None  # checked: a GPU or a profile
    return {
        "source": "estimate",
        "gpu": spec.name,
        "datasheet": spec.source,
        "compute_efficiency": spec.compute_efficiency,
        "memory_efficiency": spec.memory_efficiency,
        "kernel_us": spec.kernel_s * 1e6,
    }


def as_json(
    assumed: list[Assumption], predictions: list[cluster.ClusterPrediction], notes: list[str]
) -> dict[str, Any]:
    """The prediction as JSON: what it assumed, one entry per bucket cap, the best cap."""
    best = min(predictions, key=lambda p: (p.step_s, cap_order(p.bucket_cap_mb)))
    return {
        "assumptions": {a.key: a.value for a in assumed},
        "predictions": [
            {
                "bucket_cap_mb": p.bucket_cap_mb,
                "buckets": len(p.bucket_nbytes),
                "bucket_bytes": list(p.bucket_nbytes),
                "forward_ms": p.forward_s * 1e3,
                "backward_ms": p.backward_s * 1e3,
                "comm_ms": p.comm_s * 1e3,
                "exposed_comm_ms": p.exposed_s * 1e3,
                "slowed_by_comm_ms": p.slowed_s * 1e3,
                "optimizer_ms": p.optimizer_s * 1e3,
                "step_ms": p.step_s * 1e3,
            }
            for p in predictions
        ],
        "best": {"bucket_cap_mb": best.bucket_cap_mb, "step_ms": best.step_s * 1e3},
        "notes": list(notes),
    }


def write_trace(path: str, prediction: cluster.ClusterPrediction) -> int:
    """The predicted step as Chrome trace-event JSON (ui.perfetto.dev): one track for the
    compute stream (forward, backward, optimizer), one per process group for collectives."""
    us = 1e6
    backward_start = prediction.backward_start_s
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "predicted rank"}},
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "compute"}},
        {"name": "forward", "ph": "X", "pid": 0, "tid": 0,
         "ts": (backward_start - prediction.forward_s) * us, "dur": prediction.forward_s * us},
        {"name": "backward", "ph": "X", "pid": 0, "tid": 0, "ts": backward_start * us,
         "dur": prediction.backward_s * us},
        {"name": "optimizer", "ph": "X", "pid": 0, "tid": 0,
         "ts": (prediction.step_s - prediction.optimizer_s) * us,
         "dur": prediction.optimizer_s * us},
    ]  # fmt: skip
    groups = sorted({r.group for r in prediction.collectives})
    for g in groups:
        name = f"process group {g}"
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": 1 + g,
                       "args": {"name": name}})  # fmt: skip
    for index, record in enumerate(prediction.collectives):
        if record.start_s != record.start_s:  # NaN: never waited for, never scheduled
            continue
        events.append(
            {"name": f"{record.kind} {index}", "ph": "X", "pid": 0, "tid": 1 + record.group,
             "ts": record.start_s * us, "dur": (record.done_s - record.start_s) * us,
             "args": {"bytes": record.nbytes, "launched_us": record.launch_s * us}}
        )  # fmt: skip
    with open(path, "w") as out:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, out)
    return len(events)


def _configs(args: argparse.Namespace) -> tuple[list[cluster.ClusterConfig], list[str]]:
    if args.model not in shapes.SHAPE_MODELS:
        raise ValueError(
            f"--predict takes a model by shape: {', '.join(shapes.SHAPE_MODELS)}; got "
            f"{args.model!r}"
        )
    if args.process_groups < 1:
        raise ValueError(f"--process-groups must be >= 1, got {args.process_groups}")
    network = fakepg.parse_network(args.network)
    world_size = world_size_of(args, network)
    if world_size < 1 or args.no_sync_every < 1:
        raise ValueError("--world-size and --no-sync-every must be >= 1")
    for flag, value, what in (
        ("--host-call-us", args.host_call_us, "one collective call"),
        ("--host-hook-us", args.host_hook_us, "one gradient hook of DDP"),
    ):
        if not (value >= 0 and math.isfinite(value)):
            raise ValueError(
                f"{flag} takes the host's cost of {what} in microseconds, >= 0, got {value!r}"
            )
    notes = []
    where = "on the cores that compute" if args.shared_cores else (
        "not charged: without --shared-cores the host runs ahead of the GPU stream"
    )  # fmt: skip
    if args.host_call_us:
        notes.append(f"host's cost per collective call: {args.host_call_us:g} us ({where})")
    if args.host_hook_us:
        notes.append(f"host's cost per gradient hook: {args.host_hook_us:g} us ({where})")
    profile = None
    device = torch.device(args.device)
    if args.profile is not None:
        profile = cluster.load_profile(
            args.profile,
            model=args.model,
            batch_size=_batch(args) or shapes.SHAPE_MODELS[args.model].batch_size,
        )
        notes.append(f"compute: profile {args.profile} measured on {profile.device}")
    elif device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"--device {args.device}: this torch sees no GPU; predict from --gpu (an "
                "estimate) or --profile FILE measured on one"
            )
        profile = cluster.measure_profile(args.model, device=device, batch_size=_batch(args))
        notes.append(f"compute: measured on {profile.device} (this run, one rank)")
        if args.save_profile:
            profile.save(args.save_profile)
            notes.append(f"profile written to {args.save_profile}")
    spec = gpu.gpu_spec(args.gpu)
    if profile is None:
        notes.append(
            f"compute: ESTIMATE for {spec.name} from each kernel's FLOPs and bytes ({spec.source};"
            f" {spec.compute_efficiency:g} of FLOP peak, {spec.memory_efficiency:g} of bandwidth)"
        )
    caps: list[float | None] = [args.bucket_cap_mb]
    if args.sweep_bucket_cap:
        caps = parse_caps(args.sweep_bucket_cap)
    configs = [
        cluster.ClusterConfig(
            model=args.model,
            world_size=world_size,
            network=network,
            bucket_cap_mb=cap,
            overlap=args.overlap == "on",
            no_sync_every=args.no_sync_every,
            process_groups=args.process_groups,
            batch_size=_batch(args),
            gpu=spec,
            profile=profile,
            find_unused=args.find_unused,
            shared_cores=args.shared_cores,
            host_call_s=args.host_call_us * 1e-6,
            host_hook_s=args.host_hook_us * 1e-6,
            dtype=cluster.PREDICTED_DTYPES[args.dtype],
            seq_len=args.seq_len,
        )
        for cap in caps
    ]
    for c in configs:
        c.check()
    return configs, notes


def _batch(args: argparse.Namespace) -> int | None:
    # simulate's own default (32) is for its small models; a model by shape has its own.
    return None if args.batch_size == 32 else int(args.batch_size)


def _print(
    console: Any,
    config: cluster.ClusterConfig,
    predictions: list[cluster.ClusterPrediction],
    notes: list[str],
    elapsed: float,
    assumed: list[Assumption],
) -> None:
    network = "none (memory speed)" if config.network is None else str(config.network)
    console.print(
        f"predicted step: {config.model} at {config.world_size} ranks; overlap "
        f"{'on' if config.overlap else 'off'}, no_sync every {config.no_sync_every}, "
        f"{config.process_groups} process group(s)"
    )
    console.print(f"network: {network}", markup=False)
    for note in notes:
        console.print(note, markup=False)
    console.print("assumed (and the flag that changes it):")
    shown = [a for a in assumed if a.printed]
    width = max(len(a.key) for a in shown)
    for a in shown:
        flag = f" ({a.flag})" if a.flag else ""
        console.print(f"  {a.key.replace('_', ' '):<{width}}  {a.text}{flag}", markup=False)
    table = Table()
    for header in ("bucket cap MiB", "buckets", "forward ms", "backward ms", "comm ms",
                   "exposed comm ms", "optimizer ms", "step ms"):  # fmt: skip
        table.add_column(header, justify="right")
    best = min(predictions, key=lambda p: (p.step_s, cap_order(p.bucket_cap_mb)))
    for p in predictions:
        mark = " *" if p is best and len(predictions) > 1 else ""
        table.add_row(
            f"{cap_label(p.bucket_cap_mb)}{mark}",
            str(len(p.bucket_nbytes)),
            f"{p.forward_s * 1e3:.2f}",
            f"{p.backward_s * 1e3:.2f}",
            f"{p.comm_s * 1e3:.2f}",
            f"{p.exposed_s * 1e3:.2f}",
            f"{p.optimizer_s * 1e3:.2f}",
            f"{p.step_s * 1e3:.2f}",
        )
    console.print(table)
    if len(predictions) > 1:
        console.print(
            f"best: {report.cap_flag(best.bucket_cap_mb)} (predicted {best.step_s * 1e3:.2f} "
            f"ms per step at {config.world_size} ranks)"
        )
    console.print(f"predicted in {elapsed:.1f} s (one rank run on the meta device per cap)")
