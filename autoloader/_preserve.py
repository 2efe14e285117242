"""Leaving no trace: the state a training step changes, saved and put back.

:func:`autoloader.tune` runs the user's ``step_fn`` for real: hundreds or thousands of
forward passes, backward passes and optimizer steps, and draws from the global random
number generators (DataLoader seeds its workers from torch's, a ``RandomSampler``
without a generator draws its permutation there, the step's dropout too). So a
training run started after ``tune()`` would start from other weights and another
random stream than one started without it. :func:`preserved` saves that state before
and puts it back after, bit for bit:

- the random number generators: torch's (the CPU one, and every CUDA device's once
  CUDA is initialised), NumPy's global one and Python's ``random``;
- each ``torch.nn.Module`` given: every parameter and buffer, in place (the same
  ``Parameter`` objects, which an optimizer or a DDP wrapper holds), their gradients,
  and each submodule's ``training`` flag. The copies are kept in host memory, so that
  a model filling an accelerator's memory does not need twice that memory;
- each ``torch.Generator`` given (a sampler's or a DataLoader's), by its state;
- anything else with ``state_dict()`` and ``load_state_dict()`` (an optimizer, an LR
  scheduler, a ``GradScaler``), by a copy of its state dict.

Python attributes that a step changes outside these (a counter on the model, a metric
accumulating in a list) cannot be known from outside and are not restored.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from autoloader._exceptions import InvalidInputError


@runtime_checkable
class Stateful(Protocol):
    """An object that saves and loads its state: an optimizer, an LR scheduler, a
    ``GradScaler``."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any, /) -> Any: ...


Restorable = torch.nn.Module | torch.Generator | Stateful
_RESTORABLE = (torch.nn.Module, torch.Generator, Stateful)


def check_restorable(objects: object) -> tuple[Restorable, ...]:
    """``objects`` as a tuple of things :func:`preserved` can save, or
    :class:`InvalidInputError` naming the one it cannot."""
    if objects is None:
        return ()
    if isinstance(objects, _RESTORABLE) or not isinstance(objects, Sequence):
        objects = (objects,)
    for position, item in enumerate(objects):
        if not isinstance(item, _RESTORABLE):
            raise InvalidInputError(
                f"restore[{position}] is a {type(item).__name__}, whose state autoloader "
                "cannot save: give torch.nn.Module objects (the model), torch.Generator "
                "objects, or objects with state_dict() and load_state_dict() (the "
                "optimizer, an LR scheduler, a GradScaler)."
            )
    return tuple(objects)


@dataclass
class _RandomState:
    """The global random number generators' states."""

    torch_cpu: torch.Tensor
    numpy: Any
    python: Any
    cuda: list[torch.Tensor] | None = None

    @classmethod
    def save(cls) -> _RandomState:
        # Only once CUDA is initialised: reading its state would initialise it, and a
        # process that later forks DataLoader workers must not have done that.
        initialised = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        cuda = torch.cuda.get_rng_state_all() if initialised else None
        return cls(torch.get_rng_state(), np.random.get_state(), random.getstate(), cuda)

    def load(self) -> None:
        torch.set_rng_state(self.torch_cpu)
        np.random.set_state(self.numpy)
        random.setstate(self.python)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


@dataclass
class _ModuleState:
    """A module's tensors and modes, copied to host memory."""

    module: torch.nn.Module
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    grads: dict[str, torch.Tensor | None] = field(default_factory=dict)
    training: dict[str, bool] = field(default_factory=dict)

    @classmethod
    def save(cls, module: torch.nn.Module) -> _ModuleState:
        state = cls(module)
        for name, tensor in _tensors(module):
            state.tensors[name] = tensor.detach().to("cpu", copy=True)
            if isinstance(tensor, torch.nn.Parameter):
                grad = tensor.grad
                state.grads[name] = None if grad is None else grad.detach().to("cpu", copy=True)
        state.training = {name: sub.training for name, sub in module.named_modules()}
        return state

    def load(self) -> None:
        with torch.no_grad():
            for name, tensor in _tensors(self.module):
                saved = self.tensors.get(name)
                if saved is None:  # made by the step (a lazy module): not ours to undo
                    continue
                tensor.copy_(saved)
                if name in self.grads:
                    grad = self.grads[name]
                    tensor.grad = None if grad is None else grad.to(tensor.device)
        for name, sub in self.module.named_modules():
            if name in self.training:
                sub.training = self.training[name]


def _tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``module``, persistent or not, by name."""
    yield from module.named_parameters(remove_duplicate=True)
    yield from module.named_buffers(remove_duplicate=True)


def _to_host(value: Any) -> Any:
    """A deep copy of a state dict, its tensors in host memory."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict | list):
        # A shallow copy keeps the container's type and what it holds besides its items
        # (a defaultdict's factory); the items are then copied one by one.
        copied = copy.copy(value)
        for key in copied.keys() if isinstance(copied, dict) else range(len(copied)):
            copied[key] = _to_host(copied[key])
        return copied
    if type(value) is tuple:
        return tuple(_to_host(item) for item in value)
    return copy.deepcopy(value)


def _save(item: Restorable) -> Any:
    if isinstance(item, torch.nn.Module):
        return _ModuleState.save(item)
    if isinstance(item, torch.Generator):
        return item.get_state()
    return _to_host(item.state_dict())


def _load(item: Restorable, saved: Any) -> None:
    if isinstance(item, torch.nn.Module):
        saved.load()
    elif isinstance(item, torch.Generator):
        item.set_state(saved)
    else:
        item.load_state_dict(saved)


@contextmanager
def preserved(*objects: Restorable, rng: bool = True) -> Iterator[None]:
    """Put ``objects`` and the random number generators back as they were on entry,
    whatever happens inside (an exception and Ctrl-C included).

    :func:`autoloader.tune` uses it around the whole run: its ``restore`` argument
    names the objects, and the random number generators are always restored. Use it
    around anything else that runs training steps for a trial.

    Args:
        *objects: the model (``torch.nn.Module``), the optimizer, LR schedulers, a
            ``GradScaler`` (anything with ``state_dict()`` and ``load_state_dict()``),
            ``torch.Generator`` objects.
        rng (bool, optional): restore torch's (CPU and CUDA), NumPy's global and
            Python's random number generators too. (default: ``True``)

    Raises:
        InvalidInputError: an object whose state cannot be saved; raised on entry.

    Example::

        with autoloader.preserved(model, optimizer, scheduler):
            for batch in itertools.islice(loader, 100):
                train_step(batch)
        # model, optimizer, scheduler and the RNGs are as they were before the loop
    """
    items = check_restorable(objects)
    random_state = _RandomState.save() if rng else None
    saved = [_save(item) for item in items]
    try:
        yield
    finally:
        # Each object's state is its own copy (an optimizer's LRs are in its own state
        # dict, not its scheduler's): the order they are put back in does not matter.
        for item, state in zip(items, saved, strict=True):
            _load(item, state)
        if random_state is not None:
            random_state.load()
