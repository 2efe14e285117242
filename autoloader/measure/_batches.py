"""What a batch and a loader hold: samples in a collated batch, its tensors' bytes, and
batches in an epoch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader


def loader_length(loader: DataLoader[Any]) -> int | None:
    """Batches in one epoch of ``loader``, ``None`` where it has no length."""
    try:
        return len(loader)
    except TypeError:
        return None


def tensor_bytes(batch: Any) -> int:
    """Bytes of every tensor in a (nested) batch."""
    if isinstance(batch, torch.Tensor):
        return batch.element_size() * batch.nelement()
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, list | tuple):
        return sum(tensor_bytes(item) for item in batch)
    return 0


def batch_length(batch: Any, default: int) -> int:
    """Samples in a collated batch: the leading dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else default
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, list | tuple):
        for item in batch:
            if isinstance(item, torch.Tensor | Mapping | list | tuple):
                return batch_length(item, default)
    return default
