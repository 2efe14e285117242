"""The settings autoloader tunes, in their canonical form."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

TUNED_KEYS = (
    "num_workers",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory",
    "batched_fetch",
    "worker_threads",
    "in_order",
    "worker_kind",
    "step_threads",
)

# The kinds of worker a setting may use (see NOTE [ Thread workers ]).
WORKER_KINDS = ("processes", "threads")

Params = dict[str, Any]


def normalize_params(params: Mapping[str, Any]) -> Params:
    """Settings in canonical form: worker options are ``None``/``False``/``True`` (their
    DataLoader defaults) without workers."""
    num_workers = int(params.get("num_workers", 0))
    workers = num_workers > 0
    threads = params.get("worker_threads")
    # Thread workers start in microseconds and share this process's native thread pools.
    processes = params.get("worker_kind", "processes") != "threads"
    step = params.get("step_threads")
    return {
        "num_workers": num_workers,
        "prefetch_factor": int(params.get("prefetch_factor") or 2) if workers else None,
        "persistent_workers": bool(params.get("persistent_workers", False))
        and workers
        and processes,
        "pin_memory": bool(params.get("pin_memory", False)),
        "batched_fetch": bool(params.get("batched_fetch", False)),
        "worker_threads": int(threads) if workers and processes and threads is not None else None,
        "in_order": bool(params.get("in_order", True)) or not workers,
        "worker_kind": "processes" if processes or not workers else "threads",
        # The training process's own threads (NOTE [ Step threads ]): not a loader's.
        "step_threads": None if step is None else int(step),
    }


BASELINE_PARAMS: Params = normalize_params({"num_workers": 0})
