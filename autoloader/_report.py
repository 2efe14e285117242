"""Plain-text summaries of a tuning result."""

from __future__ import annotations

from autoloader._memory import format_bytes
from autoloader._result import TrialRecord, TuneResult


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
        *_unusual(result.params),
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


def describe(record: TrialRecord) -> str:
    """One line for the log: the setting and what it measured."""
    p = record.params
    setting = f"num_workers={p.get('num_workers')}"
    if p.get("num_workers"):
        setting += f" prefetch={p.get('prefetch_factor')} persistent={p.get('persistent_workers')}"
    if p.get("pin_memory"):
        setting += " pin_memory=True"
    setting += "".join(f" {name}={value}" for name, value in _unusual(p))
    if record.state != "complete":
        return f"trial {record.number} [{record.phase}] {setting}: {record.state} ({record.reason})"
    rate = record.samples_per_second or 0.0
    wait = record.data_wait_fraction or 0.0
    memory = format_bytes(record.peak_memory or 0)
    return (
        f"trial {record.number} [{record.phase}] {setting}: {rate:.0f} samples/s, "
        f"waits {wait:.0%} for data, peak {memory}"
    )


# Settings shown only when they differ from DataLoader's usual behaviour.
_USUAL = {"batched_fetch": False, "worker_threads": None, "in_order": True}


def _unusual(params: dict[str, object]) -> list[tuple[str, str]]:
    return [
        (name, str(params[name]))
        for name, usual in _USUAL.items()
        if name in params and params[name] != usual
    ]
