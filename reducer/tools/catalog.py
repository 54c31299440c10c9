"""What the tools know by name, listed for ``--help``: the models, the network and cluster
presets, the GPUs. Every listing reads the tables the tools use, so none can go stale."""

from __future__ import annotations

import textwrap

import fakepg

__all__ = ["clusters", "gpus", "listing", "models", "networks", "simulate_epilog"]


def models() -> list[tuple[str, str]]:
    """(name, what it is): the small built-in models simulate trains, then the real models by
    shape that ``--predict`` takes."""
    from reducer.tools.simulate import models as small
    from reducer.tools.simulate import shapes

    return [
        *((name, f"{spec.summary} (runs on threads)") for name, spec in small.MODELS.items()),
        *((name, f"{entry.summary} (by shape, for --predict)")
          for name, entry in shapes.SHAPE_MODELS.items()),
    ]  # fmt: skip


def clusters() -> list[tuple[str, str]]:
    """(name, what it is): NCCL and gloo on named machines (fakepg.CLUSTER_PRESETS)."""
    return [
        (name, fakepg.CLUSTER_DESCRIPTIONS.get(name, str(model)))
        for name, model in fakepg.CLUSTER_PRESETS.items()
    ]


def networks() -> list[tuple[str, str]]:
    """(name, what it is): the one-link presets (fakepg.NETWORK_PRESETS), each link once
    (its -ring and -tree variants said with it)."""
    out = []
    for name, model in fakepg.NETWORK_PRESETS.items():
        if name.endswith(("-ring", "-tree")):
            continue
        variants = [v for v in (f"{name}-ring", f"{name}-tree") if v in fakepg.NETWORK_PRESETS]
        also = f" (also {', '.join(variants)})" if variants else ""
        out.append((name, f"{str(model).removeprefix(f'{name}: ')}{also}"))
    return out


def gpus() -> list[tuple[str, str]]:
    """(name, datasheet): the GPUs ``--predict`` estimates compute for (``--gpu``)."""
    from reducer.tools.simulate import gpu

    return [(name, spec.source or spec.name) for name, spec in gpu.GPUS.items()]


def listing(title: str, entries: list[tuple[str, str]], *, width: int = 100) -> str:
    """A titled two-column listing, for an argparse epilog (RawDescriptionHelpFormatter)."""
    column = max(len(name) for name, _ in entries) + 2
    lines = [f"{title}:"]
    for name, text in entries:
        wrapped = textwrap.wrap(text, width - column - 2) or [""]
        lines.append(f"  {name:<{column}}{wrapped[0]}")
        lines.extend(f"  {'':<{column}}{more}" for more in wrapped[1:])
    return "\n".join(lines)


def simulate_epilog() -> str:
    """What simulate's flags name (its ``--help`` epilog, and its shortcuts')."""
    return "\n\n".join(
        (
            listing("models (--model)", models()),
            listing("cluster presets (--network)", clusters()),
            listing("link presets (--network)", networks()),
            listing("GPUs (--gpu, with --predict)", gpus()),
            "A cluster file (--network FILE.toml or FILE.json) describes nodes, GPUs per node, "
            "NVLink\nand NIC bandwidth and latency, NICs per node: see docs/howto/cli.md.",
        )
    )
