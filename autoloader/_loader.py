"""DataLoader keyword arguments from tuned settings, the user's fixed options and overrides."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from autoloader._search_space import normalize_params


def merge_loader_kwargs(
    params: Mapping[str, Any],
    *,
    batch_size: int,
    fixed: Mapping[str, Any] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Keyword arguments for ``torch.utils.data.DataLoader``; overrides win.

    Worker-only options (``prefetch_factor``, ``persistent_workers``,
    ``multiprocessing_context``) are dropped when the result has no workers: DataLoader
    rejects them then, and a baseline or an override of ``num_workers=0`` must still
    give a valid loader.
    """
    merged: dict[str, Any] = {
        "batch_size": batch_size,
        **(fixed or {}),
        **params,
        **(overrides or {}),
    }
    merged.update(normalize_params(merged))
    if merged["num_workers"] == 0:
        merged.pop("prefetch_factor", None)
        merged.pop("multiprocessing_context", None)
        merged["persistent_workers"] = False
    return merged
