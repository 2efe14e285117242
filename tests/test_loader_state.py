"""AutoLoader's state for checkpoints taken mid-epoch (NOTE [ An AutoLoader's state ]):
a loop stopped mid-epoch, while tuning or after, and resumed from the state in a new
AutoLoader gets the uninterrupted run's batches, in its order, with its generator's
state, and its tuning goes on where it stood; a Lightning fit resumed from a real
mid-epoch checkpoint too."""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler

from autoloader import AutoLoader, InvalidInputError
from tests.lazy import LazyModule
from tests.workloads import SleepDataset


def _ids(batch: torch.Tensor) -> list[int]:
    return batch[:, 0].long().tolist()


def _saved(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` through a file, read back as a checkpoint is, with weights_only."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded: dict[str, Any] = torch.load(buffer, weights_only=True)
    return loaded


def _stopped(
    loader: AutoLoader[Any], stop: Callable[[AutoLoader[Any]], bool], *, step: float = 0.002
) -> tuple[list[list[int]], dict[str, Any]]:
    """A loop stopped mid-epoch at the first batch after which ``stop`` holds (not at an
    epoch's end): the ids of its batches, and the state saved there."""
    seen: list[list[int]] = []
    for _ in range(200):
        for number, batch in enumerate(loader):
            time.sleep(step)
            seen.append(_ids(batch))
            if number < len(loader) - 2 and stop(loader):
                return seen, _saved(loader.state_dict())
    raise AssertionError("the loop never stopped")


def _resumed(loader: AutoLoader[Any], *, epochs_after: int, step: float = 0.002) -> list[list[int]]:
    """The resumed epoch's batches, then those of ``epochs_after`` more epochs once the
    loader is tuned."""
    seen: list[list[int]] = []
    after = epochs_after + 1
    for _ in range(200):
        for batch in loader:
            time.sleep(step)
            seen.append(_ids(batch))
        after -= loader.tuned
        if after <= 0:
            return seen
    raise AssertionError("tuning never ended")


def _reference(dataset: Any, batches: int, **kwargs: Any) -> tuple[list[list[int]], torch.Tensor]:
    """DataLoader's first ``batches`` batches (whole epochs), and its generator's state
    after."""
    generator = torch.Generator().manual_seed(7)
    loader = DataLoader(dataset, generator=generator, **kwargs)
    assert batches % len(loader) == 0, "the runs compared end with an epoch"
    seen = [_ids(batch) for _ in range(batches // len(loader)) for batch in loader]
    return seen, generator.get_state()


def _trials(loader: AutoLoader[Any]) -> list[tuple[Any, ...]]:
    """Each trial's number, setting, state and figures: a trial measured again would
    not have the same."""
    return [
        (
            record.number,
            dict(record.params),
            record.state,
            record.duration,
            record.samples_per_second,
        )
        for record in loader.history
    ]


_KWARGS: dict[str, Any] = {"batch_size": 8, "shuffle": True, "drop_last": True}


@pytest.mark.slow
def test_a_loop_stopped_while_tuning_resumes_batch_for_batch_and_tunes_on() -> None:
    """Stopped mid-epoch with trials finished and tuning under way: the resumed loader
    goes on at the next batch with DataLoader's batches and generator state through
    the epochs that follow, and its search goes on from the trials finished, measuring
    none of them again."""
    dataset = SleepDataset(length=250, latency=0.001)
    first = AutoLoader(
        dataset, generator=torch.Generator().manual_seed(7), time_budget=6, verbose=False, **_KWARGS
    )
    try:
        seen, state = _stopped(first, lambda loader: len(loader.history) >= 2 and not loader.tuned)
        finished = _trials(first)
    finally:
        first.close()
    assert state["_tuning"]["stage"] == "searching"
    assert len(seen) % len(first) != 0  # mid-epoch
    generator = torch.Generator().manual_seed(12345)  # the state sets it back
    second = AutoLoader(dataset, generator=generator, time_budget=6, verbose=False, **_KWARGS)
    try:
        second.load_state_dict(state)
        seen += _resumed(second, epochs_after=1)
        expected, generator_state = _reference(dataset, len(seen), **_KWARGS)
        assert seen == expected
        assert torch.equal(generator.get_state(), generator_state)
        trials = _trials(second)
        # The trials finished before the checkpoint are the resumed run's first, and
        # none is measured again: the new ones are numbered after them.
        assert trials[: len(finished)] == finished
        assert [trial[0] for trial in trials] == list(range(len(trials)))
        assert second.tuned and second.result is not None
        assert [record.number for record in second.result.trials] == list(range(len(trials)))
        # The budget spent before the checkpoint counts: the run's tuning time holds it.
        assert second.result.tuning_seconds >= state["_tuning"]["seconds"]
    finally:
        second.close()


@pytest.mark.light  # mostly waits
@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_a_loop_stopped_after_tuning_resumes_with_the_chosen_setting() -> None:
    dataset = SleepDataset(length=160, latency=0.001)
    first = AutoLoader(
        dataset, generator=torch.Generator().manual_seed(7), time_budget=3, verbose=False, **_KWARGS
    )
    try:
        seen, state = _stopped(first, lambda loader: loader.tuned)
        assert first.result is not None
        chosen, trials = first.result.params, _trials(first)
    finally:
        first.close()
    assert state["_tuning"]["stage"] == "tuned"
    generator = torch.Generator()
    second = AutoLoader(dataset, generator=generator, time_budget=3, verbose=False, **_KWARGS)
    try:
        second.load_state_dict(state)
        assert second.state_dict() == state  # loaded, for the next epoch
        seen += _resumed(second, epochs_after=2)
        assert second.result is not None and second.result.params == chosen
        assert _trials(second) == trials  # nothing tuned again
        assert second.num_workers == chosen["num_workers"]
    finally:
        second.close()
    expected, generator_state = _reference(dataset, len(seen), **_KWARGS)
    assert seen == expected
    assert torch.equal(generator.get_state(), generator_state)


def test_the_global_generator_is_replayed_and_put_back() -> None:
    """Without a generator, DataLoader draws from torch's global one: the resumed epoch
    is drawn from its state at the epoch's start, and the caller's is put back (a user
    who restores it with the checkpoint gets every later epoch too)."""
    dataset = SleepDataset(length=100, latency=0.0)
    torch.manual_seed(5)
    expected = [_ids(batch) for _ in range(3) for batch in DataLoader(dataset, **_KWARGS)]
    torch.manual_seed(5)
    first = AutoLoader(dataset, time_budget=2, verbose=False, **_KWARGS)
    try:
        batches = iter(range(1000))
        seen, state = _stopped(first, lambda loader: next(batches) >= 14, step=0.0)
        users = torch.get_rng_state()  # the training's own, saved with the checkpoint
    finally:
        first.close()
    torch.manual_seed(99)
    second = AutoLoader(dataset, time_budget=2, verbose=False, **_KWARGS)
    try:
        second.load_state_dict(state)
        torch.set_rng_state(users)
        epoch = iter(second)
        assert torch.equal(torch.get_rng_state(), users)  # put back as it was
        seen += [_ids(batch) for batch in epoch]
        seen += [_ids(batch) for _ in range(3 - len(seen) // len(second)) for batch in second]
    finally:
        second.close()
    assert seen == expected


def test_a_loader_passed_through_resumes_as_dataloader() -> None:
    """A batch_sampler (not tuned): the delivered batches are loaded again and dropped,
    its sampler's generator set back."""
    dataset = SleepDataset(length=100, latency=0.0)

    def batch_sampler(seed: int) -> BatchSampler:
        sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(seed))
        return BatchSampler(sampler, batch_size=8, drop_last=False)

    reference = DataLoader(dataset, batch_sampler=batch_sampler(3))
    expected = [_ids(batch) for _ in range(2) for batch in reference]
    first = AutoLoader(dataset, batch_sampler=batch_sampler(3), verbose=False)
    seen: list[list[int]] = []
    for batch in first:
        seen.append(_ids(batch))
        if len(seen) == 5:
            state = _saved(first.state_dict())
            break
    second = AutoLoader(dataset, batch_sampler=batch_sampler(42), verbose=False)
    second.load_state_dict(state)
    seen += [_ids(batch) for _ in range(2) for batch in second]
    assert seen == expected


def test_a_state_of_other_arguments_or_a_loader_that_began_is_refused() -> None:
    dataset = SleepDataset(length=64, latency=0.0)
    first = AutoLoader(dataset, batch_size=8, time_budget=2, verbose=False)
    epoch = iter(first)
    next(epoch)
    state = first.state_dict()
    with pytest.raises(InvalidInputError, match="has started tuning"):
        first.load_state_dict(state)
    first.close()
    other = AutoLoader(dataset, batch_size=4, time_budget=2, verbose=False)
    with pytest.raises(InvalidInputError, match="batch size: 8 then, 4 now"):
        other.load_state_dict(state)
    with pytest.raises(InvalidInputError, match=r"what AutoLoader\.state_dict"):
        other.load_state_dict({"_num_yielded": 3})
    other.load_state_dict({})  # nothing to load, as torchdata's


# A real Lightning fit, checkpointed mid-epoch and resumed with ckpt_path ----------------

# Imported by the test that uses them (tests/lazy.py): skipped without Lightning.
pl = LazyModule("lightning.pytorch")
models = LazyModule("tests.lightning_models")


def _fit(
    loader: DataLoader[Any], root: Path, *, every: int | None = None, ckpt: Path | None = None
) -> Any:
    callbacks = []
    if every is not None:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(
                dirpath=root, every_n_train_steps=every, save_top_k=-1, filename="{step}"
            )
        )
    model = models.Recording(loader)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=4,
        callbacks=callbacks,
        logger=False,
        default_root_dir=root,
        enable_checkpointing=every is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, ckpt_path=ckpt)
    return model


@pytest.mark.slow
@pytest.mark.late  # imports Lightning (tests/seats.py)
def test_a_lightning_fit_resumed_from_a_mid_epoch_checkpoint_goes_on_as_uninterrupted(
    tmp_path: Path,
) -> None:
    """ModelCheckpoint every 9 steps (12 batches an epoch): a fit resumed from the step-18
    checkpoint (mid-epoch) or the step-36 one (an epoch's last batch) trains on exactly
    the batches the uninterrupted fit had after it, DataLoader's, and its tuning takes
    up the checkpoint's trials."""
    dataset = SleepDataset(length=96, latency=0.004)

    def loader(seed: int) -> AutoLoader[Any]:
        generator = torch.Generator().manual_seed(seed)
        return AutoLoader(
            dataset, batch_size=8, shuffle=True, generator=generator, time_budget=4, verbose=False
        )

    whole = _fit(loader(7), tmp_path / "whole", every=9)
    assert isinstance(whole.loader, AutoLoader)
    reference = DataLoader(
        dataset, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(7)
    )
    assert _fit(reference, tmp_path / "reference").seen == whole.seen
    for step, next_batch in ((18, 6), (36, 0)):
        checkpoint = tmp_path / "whole" / f"step={step}.ckpt"
        saved = torch.load(checkpoint, weights_only=True)["loops"]["fit_loop"]["state_dict"]
        (state,) = saved["combined_loader"]  # Lightning saved the AutoLoader's state
        assert state["_num_yielded"] == next_batch
        assert state["_iterator_finished"] is (next_batch == 0)  # the next epoch next
        resumed = _fit(loader(1), tmp_path / f"resumed-{step}", ckpt=checkpoint)
        assert whole.seen[:step] + resumed.seen == whole.seen
        assert isinstance(resumed.loader, AutoLoader)
        tuning = state["_tuning"]
        finished = len(tuning["session"]["trials"]) if tuning["stage"] == "searching" else 0
        assert _trials(resumed.loader)[:finished] == _trials(whole.loader)[:finished]
