"""What ``python -m reducer simulate`` shows: a progress bar, the summary, the sweep table.

Rendering only; the numbers come from the simulation's records. The progress bar goes to
stderr and only to a terminal; the tables go to stdout.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from reducer.tools.whatif import cap_label

if TYPE_CHECKING:
    from reducer.tools.trace import RankStep
    from reducer.tools.whatif import BackwardProfile, Prediction

    from .records import Config, SimulationResult

__all__: list[str] = []

Advance = Callable[[int, int, str], None]


def console() -> Console:
    """stdout; a fixed width when it is not a terminal, so that tables do not wrap at 80."""
    return Console(highlight=False, width=None if sys.stdout.isatty() else 120)


@contextmanager
def progress_bar(out: Console, enabled: bool) -> Iterator[Advance | None]:
    """A bar on stderr while the steps run; yields ``advance(done, total, text)``."""
    err = Console(stderr=True)
    if not enabled or not err.is_terminal:
        yield None
        return
    columns = (
        TextColumn("[bold]simulate"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("steps"),
        TimeElapsedColumn(),
        TextColumn("{task.fields[text]}"),
    )
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task("steps", total=None, text="building the ranks")

        def advance(done: int, total: int, text: str) -> None:
            bar.update(task, completed=done, total=total, text=text)

        yield advance


def _ms(ns: float) -> str:
    return f"{ns / 1e6:.3f}"


def _size(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def _sizes(nbytes: Sequence[int], sparse_buckets: int = 0, limit: int = 8) -> str:
    shown = ", ".join(_size(n) for n in nbytes[:limit])
    if len(nbytes) > limit:
        shown += f", ... ({len(nbytes) - limit} more)"
    if sparse_buckets:
        shown += f"; {sparse_buckets} sparse"
    return shown


def step_timings(steps: Sequence[RankStep], wall_ns: Sequence[int]) -> dict[str, list[float]]:
    """Per step, the mean over ranks of each phase (ns); the step's wall time as measured."""
    by_step: dict[int, list[RankStep]] = {}
    for record in steps:
        by_step.setdefault(record.step, []).append(record)
    rows: dict[str, list[float]] = {
        "forward": [],
        "backward": [],
        "comm (first launch to last done)": [],
        "overlap with backward": [],
        "exposed comm (after last gradient)": [],
        "optimizer": [],
    }
    for records in by_step.values():
        its = [r.iteration for r in records if r.iteration is not None]
        n = len(records)
        rows["forward"].append(
            sum(p.forward.end_ns - p.forward.start_ns for r in records for p in r.passes) / n
        )
        rows["backward"].append(
            sum(p.backward.end_ns - p.backward.start_ns for r in records for p in r.passes) / n
        )
        if its:
            rows["comm (first launch to last done)"].append(
                sum(it.comm_ns for it in its) / len(its)
            )
            rows["overlap with backward"].append(sum(it.overlap_ns for it in its) / len(its))
            rows["exposed comm (after last gradient)"].append(
                sum(max(0, max(it.done_ns) - it.backward_ns) for it in its) / len(its)
            )
        optimizer = [r.optimizer.end_ns - r.optimizer.start_ns for r in records if r.optimizer]
        if optimizer:
            rows["optimizer"].append(sum(optimizer) / len(optimizer))
    rows["step (wall, all ranks)"] = [float(w) for w in wall_ns]
    return rows


def print_summary(out: Console, config: Config, result: SimulationResult) -> None:
    """The run's settings, its buckets, timings and the verdict."""
    sparse_count = sum(result.sparse)
    info = Table(title="simulate", show_header=False, title_justify="left")
    info.add_column("what", style="bold")
    info.add_column("value")
    numel = sum(p.numel() for p in result.params)
    info.add_row(
        "model",
        f"{config.model}: {len(result.param_names)} parameters, {numel:,} elements"
        + (f" ({sparse_count} with sparse gradients)" if sparse_count else ""),
    )
    info.add_row("ranks", f"{result.world_size} (threads of one process, fake world)")
    passes = f", {config.micro_batches} micro-batches each" if config.micro_batches > 1 else ""
    info.add_row("steps", f"{result.verified_steps} verified of {config.steps}{passes}")
    info.add_row("network", config.network_name())
    hook = "" if config.comm_hook == "none" else f", comm hook {config.comm_hook}"
    info.add_row(
        "reducer",
        f"bucket cap {_cap(config.bucket_cap_mb)}, find_unused_parameters="
        f"{config.find_unused}, unused pattern {config.unused_pattern}{hook}",
    )
    if result.bucket_nbytes:
        dense = [n for n in result.bucket_nbytes if n > 0]
        info.add_row(
            "buckets",
            f"{len(result.bucket_nbytes)}: {_sizes(dense, len(result.bucket_nbytes) - len(dense))}",
        )
    if result.unused_local:
        names = ", ".join(sorted(result.unused_names)[:6])
        info.add_row(
            "unused parameters",
            f"{result.unused_local} (rank, step, parameter) without a local gradient; "
            f"{result.unused_everywhere} (step, parameter) unused on every rank; {names}",
        )
    else:
        info.add_row("unused parameters", "none")
    out.print(info)
    if result.steps:
        out.print(_timing_table(result))
    # Plain lines, never wrapped, so that logs and scripts can find them.
    for note in result.notes:
        out.print(note, soft_wrap=True)
    out.print(f"verification: {_verdict(config, result)}", soft_wrap=True)


def _verdict(config: Config, result: SimulationResult) -> str:
    if result.mismatch is not None:
        return f"[bold red]FAILED[/] at {result.mismatch.message()}"
    if result.failure is not None:
        return f"[bold red]FAILED[/] {result.failure}"
    kinds = "bit-exact (torch.equal) against the rank-order average"
    if any(result.sparse):
        kinds += "; sparse within the reordering bound"
    return (
        f"[bold green]passed[/]: {result.verified_steps} steps x {result.world_size} ranks x "
        f"{len(result.param_names)} parameters, {kinds}; parameters identical on every rank"
    )


def _timing_table(result: SimulationResult) -> Table:
    table = Table(
        title="per step: mean over ranks, in ms (median, min, max over steps)",
        title_justify="left",
    )
    for name in ("phase", "median", "min", "max"):
        table.add_column(name, justify="left" if name == "phase" else "right")
    for name, values in step_timings(result.steps, result.step_wall_ns).items():
        if values:
            table.add_row(name, _ms(statistics.median(values)), _ms(min(values)), _ms(max(values)))
    return table


def print_sweep(
    out: Console,
    config: Config,
    measure: Config,
    result: SimulationResult,
    profile: BackwardProfile,
    predictions: Sequence[Prediction],
    chosen: Prediction,
) -> None:
    """The measured profile, the prediction per cap, and the best cap."""
    out.print(
        f"measured: {measure.model}, {measure.world_size} rank(s), {result.verified_steps} "
        f"verified steps: forward {_ms(profile.forward_ns)} ms, last gradient ready "
        f"{_ms(max(profile.ready_ns))} ms after it, finalize tail {_ms(profile.tail_ns)} ms, "
        f"optimizer {_ms(profile.optimizer_ns)} ms"
    )
    table = Table(
        title=f"predicted step at {config.world_size} ranks on {config.network_name()}",
        title_justify="left",
    )
    headers = ("bucket cap MiB", "buckets", "largest", "comm ms", "exposed comm ms", "step ms")
    for name in headers:
        table.add_column(name, justify="right")
    for p in predictions:
        mark = " *" if p is chosen else ""
        table.add_row(
            f"{cap_label(p.bucket_cap_mb)}{mark}",
            str(len(p.bucket_nbytes)),
            _size(max(p.bucket_nbytes)),
            _ms(p.comm_ns),
            _ms(p.exposed_ns),
            _ms(p.step_ns),
        )
    out.print(table)
    out.print(
        f"best: {cap_flag(chosen.bucket_cap_mb)} (predicted {_ms(chosen.step_ns)} "
        f"ms per step at {config.world_size} ranks)"
    )


def _cap(bucket_cap_mb: float | None) -> str:
    """The reducer row's cap: torch's default spelled out."""
    if bucket_cap_mb is None:
        return "25 MiB (torch's default: the first bucket 1 MiB)"
    return f"{bucket_cap_mb:g} MiB"


def cap_flag(bucket_cap_mb: float | None) -> str:
    """The command-line setting that gives ``bucket_cap_mb``."""
    if bucket_cap_mb is None:
        return "the default bucket cap (no --bucket-cap-mb)"
    return f"--bucket-cap-mb {bucket_cap_mb:g}"
