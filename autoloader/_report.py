"""Plain-text summaries of a tuning result."""

from __future__ import annotations

from autoloader._memory import format_bytes
from autoloader._result import TuneResult


def summary(result: TuneResult) -> str:
    """A short table: the tuned settings, throughput against the baseline, the trials."""
    states = [t.state for t in result.trials]
    chosen = [t for t in result.trials if t.state == "complete" and t.params == result.params]
    wait = chosen[-1].data_wait_fraction if chosen else None
    peak = max((t.peak_memory or 0 for t in chosen), default=0)
    rows = [
        ("num_workers", str(result.params["num_workers"])),
        ("prefetch_factor", str(result.params["prefetch_factor"])),
        ("persistent_workers", str(result.params["persistent_workers"])),
        ("pin_memory", str(result.params["pin_memory"])),
        ("throughput", f"{result.throughput:,.0f} samples/s"),
        ("baseline (num_workers=0)", f"{result.baseline:,.0f} samples/s"),
        ("speedup", f"{result.speedup:.2f}x"),
    ]
    if wait is not None:
        rows.append(("time waiting for data", f"{wait:.0%}"))
    if peak:
        rows.append(("peak memory (process tree)", format_bytes(peak)))
    rows.append(
        (
            "trials",
            f"{len(states)} run, {states.count('pruned')} pruned, "
            f"{states.count('failed')} failed, in {result.tuning_seconds:.0f} s",
        )
    )
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    lines.extend(f"note: {note}" for note in result.notes)
    return "\n".join(lines)
