"""The device batches are moved to before ``step_fn``, and the accelerator on this machine."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from autoloader._exceptions import InvalidInputError

# Device types that run synchronously on the host: nothing to wait for.
_HOST_DEVICE_TYPES = frozenset({"cpu", "meta"})


def accelerator() -> torch.device | None:
    """This machine's accelerator (CUDA, XPU, MPS...), or ``None`` without one."""
    if not torch.accelerator.is_available():
        return None
    return torch.accelerator.current_accelerator()


def resolve_device(device: str | torch.device | None) -> torch.device | None:
    """Check ``device`` and return it as a ``torch.device``.

    Raises:
        InvalidInputError: the device is malformed, or an accelerator it names is absent.
    """
    if device is None:
        return None
    if not isinstance(device, str | torch.device):
        raise InvalidInputError(
            f"device must be a str or torch.device such as 'cuda:0', but got "
            f"{type(device).__name__} {device!r}."
        )
    try:
        resolved = torch.device(device)
    except RuntimeError as error:
        raise InvalidInputError(f"device {device!r} is not a valid torch device: {error}") from None
    if resolved.type not in _HOST_DEVICE_TYPES:
        found = accelerator()
        if found is None or found.type != resolved.type:
            raise InvalidInputError(
                f"device {device!r} was requested but this machine's accelerator is "
                f"{found.type if found else 'absent'}; pass device=None to tune on the CPU."
            )
    return resolved


def move_to_device(batch: Any, device: torch.device, *, non_blocking: bool) -> Any:
    """Move every tensor in a (nested) batch to ``device``, as a training loop would."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, Mapping):
        mapping_type: Any = type(batch)
        return mapping_type(
            {k: move_to_device(v, device, non_blocking=non_blocking) for k, v in batch.items()}
        )
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(move_to_device(v, device, non_blocking=non_blocking) for v in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(move_to_device(v, device, non_blocking=non_blocking) for v in batch)
    return batch


def synchronize(device: torch.device | None) -> None:
    """Wait for the work queued on ``device``, so a timestamp includes it."""
    if device is None or device.type in _HOST_DEVICE_TYPES:
        return
    torch.accelerator.synchronize(device)
