"""An AutoLoader's state for checkpoints taken mid-epoch, in the protocol of torchdata's
``StatefulDataLoader``: where the epoch stands (:func:`in_epoch`, :func:`between_epochs`,
replayed by :class:`Draws`), and how a state is checked (:func:`checked`); the tuning's part of it,
written (:func:`tuned_state`, :func:`searching_state`) and read (:func:`checked_tuning`).

NOTE [ An AutoLoader's state ]
``state_dict()`` may be called at any time: before the first epoch, between two of the
loop's ``next()`` calls, after an epoch; ``load_state_dict()`` applies it to the next
``iter()`` of an AutoLoader of the same arguments, as StatefulDataLoader's do (and as
Lightning calls them, on a stateful train loader, at a checkpoint and before the resumed
fit's first ``iter()``). The state holds plain values and tensors only (a checkpoint
loaded with ``torch.load(weights_only=True)`` keeps it):

- Where the epoch stands. The settings take turns at the epoch's batches in the
  sampler's order and deliver them in order (``NOTE [ Every batch once ]``), so the
  batches the loop got are always the epoch's first ones: the state keeps how many
  (``_num_yielded``; a batch that raised in the loop counts, consumed as DataLoader
  consumes it) and the states, at the epoch's start, of the generators its draws come
  from: the loader's ``generator`` (where it has none, torch's global generator, which
  DataLoader draws from then) and the sampler's own. The resumed epoch sets them back,
  draws what DataLoader draws (the sampler's iterator, the workers' base seed), and
  takes the delivered batches off the sampler without loading them: its next batch is
  the first undelivered one, and the generators end the epoch where the uninterrupted
  run's would. The global generator is put back as the caller had it, being the
  training's too. Between epochs (the loop got the epoch's last batch, or dropped the
  epoch: ``_iterator_finished``), the state is the generators' states then, and the
  resumed ``iter()`` starts the next epoch, as the uninterrupted run's next ``iter()``
  would (so does StatefulDataLoader; Lightning, which stops an epoch at its length,
  resumes from a checkpoint at its last batch with a new ``iter()``). A loader passed
  through untuned loads and drops the delivered batches instead (it has no batches of
  indices to skip), as StatefulDataLoader does for a dataset without a state of its own.
- Where the tuning stands (``NOTE [ AutoLoader's tuning ]``, ``LoopTuning.state``).
  While it searches: the trials finished, as the study keeps them, and the part of the
  budget spent; the resumed run tells them to its new study and searches on with the
  rest of the budget, measuring none of them again (the trial under way at the
  checkpoint, unfinished, is not one of them). Once tuned: the result and the setting
  loading the batches (a failure in training may have changed it), taken again without
  tuning.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from autoloader._exceptions import InvalidInputError, ResultFileError
from autoloader.loader import Params, normalize_params
from autoloader.results import TuneResult

VERSION = 1
# The parts of the problem (Problem.key) a state must share with the loader resuming it:
# the batches (and the trials, measured over them) of another would not be its.
_SAME_PARTS = ("dataset", "dataset length", "batch size", "fixed loader options", "search space")


@dataclass(frozen=True, slots=True)
class Draws:
    """The states of the generators an epoch draws from, taken at its start."""

    generator: torch.Tensor | None  # the loader's own, where it has one
    sampler: torch.Tensor | None  # the sampler's own, where it has one
    global_: torch.Tensor | None  # torch's global one, where the loader has none

    @classmethod
    def now(cls, loader: Any, *, global_too: bool) -> Draws:
        """The states of ``loader``'s generators now (the global one's with
        ``global_too``, where the loader has no generator)."""
        generator, sampler = _generators(loader)
        return cls(
            None if generator is None else generator.get_state(),
            None if sampler is None else sampler.get_state(),
            torch.get_rng_state() if global_too and generator is None else None,
        )

    @contextlib.contextmanager
    def replayed(self, loader: Any) -> Iterator[None]:
        """Within: ``loader``'s generators as they were; the global one put back after."""
        generator, sampler = _generators(loader)
        if generator is not None and self.generator is not None:
            generator.set_state(self.generator)
        if sampler is not None and self.sampler is not None:
            sampler.set_state(self.sampler)
        if self.global_ is None:
            yield
            return
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self.global_)
            yield


def _generators(loader: Any) -> tuple[torch.Generator | None, torch.Generator | None]:
    """The generator ``loader`` draws its base seed from (``None``: the global one), and
    its sampler's own where that is another (a batch sampler's sampler's, where it was
    given one)."""
    generator = loader.generator
    batch_sampler = loader.batch_sampler
    source = loader.sampler if batch_sampler is None else getattr(batch_sampler, "sampler", None)
    sampler = getattr(source, "generator", None)
    if not isinstance(sampler, torch.Generator) or sampler is generator:
        sampler = None
    return generator, sampler


def in_epoch(draws: Draws, done: int) -> dict[str, Any]:
    """The state of a loader in an epoch the loop holds: its generators' states at its
    start, and the batches the loop got."""
    return _state(draws, done, finished=False)


def between_epochs(loader: Any) -> dict[str, Any]:
    """The state of a loader between epochs (none yet, the last ended, or the loop
    dropped it): the next epoch draws from its generators as they are now, as the
    uninterrupted run's next ``iter()`` would."""
    return _state(Draws.now(loader, global_too=False), 0, finished=True)


def _state(draws: Draws, done: int, *, finished: bool) -> dict[str, Any]:
    return {
        "_autoloader_state": VERSION,
        "_num_yielded": done,
        "_iterator_finished": finished,
        "_generator_state": draws.generator,
        "_sampler_generator_state": draws.sampler,
        "_global_rng_state": draws.global_,
    }


def position_of(state: Mapping[str, Any]) -> tuple[Draws, int]:
    """What a state dict says of the epoch to resume: its generators' states at its
    start, and the batches to skip (none after an epoch's end)."""
    draws = Draws(
        state["_generator_state"], state["_sampler_generator_state"], state["_global_rng_state"]
    )
    return draws, 0 if state["_iterator_finished"] else int(state["_num_yielded"])


def checked(state: object, problem: Mapping[str, str] | None) -> dict[str, Any]:
    """``state``, where it is an AutoLoader's state of ``problem`` (``None``: a loader
    passed through untuned, which has none).

    Raises:
        InvalidInputError: it is not, or of another problem.
    """
    if not isinstance(state, Mapping) or state.get("_autoloader_state") != VERSION:
        found = state.get("_autoloader_state") if isinstance(state, Mapping) else None
        raise InvalidInputError(
            "AutoLoader.load_state_dict() takes what AutoLoader.state_dict() returned "
            f"(version {VERSION}), but got "
            + (f"version {found}" if found is not None else f"a {type(state).__name__}")
            + ": resume from a checkpoint this version of autoloader saved, or start the "
            "epoch over without loading it."
        )
    saved = state.get("_problem")
    if problem is not None and saved is not None:
        differences = [
            f"{part}: {saved.get(part)} then, {problem.get(part)} now"
            for part in _SAME_PARTS
            if saved.get(part) != problem.get(part)
        ]
        if differences:
            raise InvalidInputError(
                "AutoLoader.load_state_dict(): the state is of a loader with other "
                f"arguments ({'; '.join(differences)}); its batches would not be this "
                "loader's. Resume with the arguments of the loader that saved it."
            )
    return dict(state)


def tuned_state(
    result: TuneResult, chosen: Params, last_good: Params, failures: list[str]
) -> dict[str, Any]:
    """The tuning's part of a state once tuned: its ``result``, the setting ``chosen``
    loading the batches, the last good one and the failures so far."""
    return {
        "stage": "tuned",
        # Plain JSON values: the torch version is a str subclass torch.load's
        # weights_only refuses.
        "result": json.loads(json.dumps(result.as_dict())),
        "chosen": dict(chosen),
        "last_good": dict(last_good),
        "failures": list(failures),
    }


def searching_state(
    seconds: float, session: dict[str, Any] | None, last_good: Params, failures: list[str]
) -> dict[str, Any]:
    """The tuning's part of a state while it searches: the ``seconds`` of budget spent,
    its session's checkpoint (``None`` on a rank that does not drive the study), the
    last good setting and the failures so far."""
    return {
        "stage": "searching",
        "seconds": seconds,
        "session": session,
        "last_good": dict(last_good),
        "failures": list(failures),
    }


def checked_tuning(state: Mapping[str, Any]) -> dict[str, Any] | None:
    """The tuning's part of a state (``LoopTuning.state``), where the tuning stood at
    the checkpoint: ``None`` where it waited for its first batch.

    Raises:
        InvalidInputError: ``state`` is not a tuning's.
    """
    stage = state.get("stage")
    try:
        if stage == "tuned":
            TuneResult.from_dict(state["result"])
            normalize_params(state["chosen"])
        elif stage == "searching":
            float(state["seconds"])
        elif stage != "waiting":
            raise ValueError(f"a tuning stage {stage!r}")
        if stage != "waiting":
            normalize_params(state["last_good"])
            list(state["failures"])
    except (KeyError, TypeError, ValueError, ResultFileError) as error:
        raise InvalidInputError(
            f"AutoLoader.load_state_dict(): the state's tuning is not readable ({error}); "
            "resume from a checkpoint this version of autoloader saved."
        ) from None
    return None if stage == "waiting" else dict(state)
