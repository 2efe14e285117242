"""``autoloader.plot(result)``: what the trials measured, as a picture (matplotlib, optional).

Every rate drawn is the one the report gives and the settings were chosen by: samples
per second over a training epoch, worker start-up included (``NOTE [ Headline rates ]``
in ``_report.py``). Left: those samples/s against ``num_workers``, one line per
``prefetch_factor`` (and per fetch mode where batched fetch was searched, per worker
kind where threads and processes were both measured), the best of each setting's other
options at each point; the step's ceiling and the baseline as horizontal lines; the
tuned setting starred; pruned trials (which have no epoch rate) as crosses at the
steady rate they had when stopped, failed ones, and those too short to measure, as
triangles on the axis. Right: the search's history, trial by trial, with the best so
far.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autoloader.results._record import TrialRecord
from autoloader.results._result import TuneResult

if TYPE_CHECKING:
    from matplotlib.figure import Figure

_PHASE_COLOURS = {"baseline": "tab:gray", "search": "tab:blue", "runoff": "tab:orange"}


def plot(result: TuneResult, path: str | os.PathLike[str] | None = None) -> Figure:
    """Draw the trials of ``result``: samples/s against ``num_workers``, one line per
    ``prefetch_factor``, the step's ceiling and the baseline, pruned and failed trials
    marked; and the search's history. Needs matplotlib
    (``pip install "torch-autoloader[plot]"``).

    Args:
        result: what :func:`autoloader.tune` returned or :func:`autoloader.load` read.
        path: where to save the figure (PNG, SVG, PDF by the suffix); ``None`` only
            returns it.

    Returns:
        The ``matplotlib.figure.Figure``.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError(
            "autoloader.plot() needs matplotlib: pip install 'torch-autoloader[plot]' "
            "(or pip install matplotlib)."
        ) from None
    # A Figure made directly, not through pyplot: no GUI backend, no global state.
    figure = Figure(figsize=(12, 4.8), layout="constrained")
    by_workers, history = figure.subplots(1, 2, width_ratios=(3, 2))
    _draw_by_workers(by_workers, result)
    _draw_history(history, result)
    figure.suptitle(
        f"autoloader: batch size {result.batch_size}, {result.environment.usable_cpus} CPUs, "
        f"tuned {result.throughput:,.0f} samples/s over an epoch = {result.versus_defaults()}"
    )
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, dpi=110)
    return figure


def _rate(record: TrialRecord) -> float | None:
    """Samples/s over an epoch, as ``TuneResult.throughput`` and ``baseline``; a pruned
    trial has only the steady estimate it was stopped on, and one too short to measure
    none."""
    if record.too_short:
        return None
    return record.epoch_samples_per_second or record.samples_per_second


def _draw_by_workers(axes: Any, result: TuneResult) -> None:
    _draw_lines(axes, result)
    _draw_references(axes, result)
    _draw_unfinished(axes, result)
    axes.scatter(
        [result.params["num_workers"]],
        [result.throughput],
        marker="*",
        s=320,
        facecolors="none",  # hollow: the measured point under it stays visible
        edgecolors="black",
        linewidths=1.3,
        zorder=4,
        label="tuned (median of its runs)",
    )
    axes.set_xlabel("num_workers")
    axes.set_ylabel("samples/s over an epoch")
    axes.set_title("Throughput by setting (best of the other options)")
    axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc="lower right")


def _draw_lines(axes: Any, result: TuneResult) -> None:
    """One line per prefetch factor (and fetch mode, worker kind), the best of the
    other options at each worker count."""
    complete = [t for t in result.trials if t.state == "complete" and _rate(t)]
    batched_searched = len({bool(t.params.get("batched_fetch")) for t in complete}) > 1
    kinds = {t.params.get("worker_kind", "processes") for t in complete if t.params["num_workers"]}
    lines: dict[str, dict[int, float]] = defaultdict(dict)
    for trial in complete:
        workers = trial.params["num_workers"]
        if workers == 0:
            label = "num_workers=0"
        else:
            label = f"prefetch {trial.params.get('prefetch_factor')}"
            if len(kinds) > 1:
                label = f"{trial.params.get('worker_kind', 'processes')}, {label}"
        if batched_searched:
            label += ", batched" if trial.params.get("batched_fetch") else ", per item"
        best = lines[label]
        best[workers] = max(best.get(workers, 0.0), _rate(trial) or 0.0)
    for label in sorted(lines, key=_line_order):
        points = sorted(lines[label].items())
        xs, ys = zip(*points, strict=True)
        axes.plot(xs, ys, marker="o", markersize=4, label=label)


def _draw_references(axes: Any, result: TuneResult) -> None:
    """The defaults' rate, and the step's ceiling where it is known."""
    axes.axhline(result.baseline, color="tab:gray", linestyle="--", linewidth=1)
    axes.annotate(
        f"defaults {result.baseline:,.0f}",
        (0, result.baseline),
        xytext=(12, 3),
        textcoords="offset points",
        color="tab:gray",
        fontsize=8,
    )
    ceiling = result.step_ceiling
    if ceiling:
        axes.axhline(ceiling, color="tab:red", linestyle=":", linewidth=1.2)
        axes.annotate(
            f"step ceiling {ceiling:,.0f}",
            (0, ceiling),
            xytext=(2, -10),
            textcoords="offset points",
            color="tab:red",
            fontsize=8,
        )


def _draw_unfinished(axes: Any, result: TuneResult) -> None:
    """Pruned trials at the rate they were stopped on; failed ones, and those too short
    to measure, on the axis."""
    pruned = [t for t in result.trials if t.state == "pruned" and not t.too_short]
    if pruned:
        axes.scatter(
            [t.params.get("num_workers", 0) for t in pruned],
            [_rate(t) or 0.0 for t in pruned],
            marker="x",
            color="tab:purple",
            label=f"pruned ({len(pruned)})",
            zorder=3,
        )
    for unmeasured, marker, colour in (
        ([t for t in result.trials if t.state == "failed"], "v", "tab:red"),
        ([t for t in result.trials if t.too_short], "^", "tab:gray"),
    ):
        if not unmeasured:
            continue
        label = "failed" if unmeasured[0].state == "failed" else "too short to measure"
        axes.scatter(
            [t.params.get("num_workers", 0) for t in unmeasured],
            [0.0] * len(unmeasured),
            marker=marker,
            color=colour,
            label=f"{label} ({len(unmeasured)})",
            zorder=3,
            clip_on=False,
        )


def _draw_history(axes: Any, result: TuneResult) -> None:
    best = 0.0
    steps: list[tuple[int, float]] = []
    for trial in result.trials:
        rate = _rate(trial) or 0.0
        marker = {"complete": "o", "pruned": "x", "failed": "v"}.get(trial.state, "o")
        axes.scatter(
            trial.number,
            rate,
            marker=marker,
            color=_PHASE_COLOURS.get(trial.phase, "tab:blue"),
            s=22,
            zorder=3,
        )
        if trial.state == "complete" and trial.phase != "runoff":
            best = max(best, rate)
            steps.append((trial.number, best))
    if steps:
        xs, ys = zip(*steps, strict=True)
        axes.step(xs, ys, where="post", color="black", linewidth=1, label="best so far")
    for phase, colour in _PHASE_COLOURS.items():
        if any(t.phase == phase for t in result.trials):
            axes.scatter([], [], color=colour, s=22, label=phase)
    axes.set_xlabel("trial")
    axes.set_ylabel("samples/s over an epoch")
    axes.set_title(f"Search history ({len(result.trials)} trials, {result.tuning_seconds:.0f} s)")
    axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc="best")


def _line_order(label: str) -> tuple[int, str]:
    return (0 if label.startswith("num_workers=0") else 1, label)
