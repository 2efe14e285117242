"""A progress bar for a tuning run: time spent against the budget, trials, best rate."""

from __future__ import annotations

import sys
from time import perf_counter
from types import TracebackType

from tqdm import tqdm

from autoloader.results._record import TrialRecord


class Progress:
    """Shows tuning progress on stderr while enabled and stderr is a terminal.

    Args:
        time_budget (float): seconds of the run; the bar's length.
        enabled (bool): ``False`` shows nothing.
    """

    def __init__(self, *, time_budget: float, enabled: bool) -> None:
        self._started = perf_counter()
        self._counts = {"complete": 0, "pruned": 0, "failed": 0}
        self._best = 0.0
        self._bar = tqdm(
            total=round(time_budget),
            desc="autoloader",
            unit="s",
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total}s {postfix}",
            disable=not (enabled and sys.stderr.isatty()),
            leave=False,
        )

    def trial_done(self, record: TrialRecord) -> None:
        self._counts[record.state] = self._counts.get(record.state, 0) + 1
        # The rate settings are chosen by: over an epoch, start-up included.
        rate = record.epoch_samples_per_second or record.samples_per_second
        if record.state == "complete" and rate:
            self._best = max(self._best, rate)
        elapsed = min(perf_counter() - self._started, float(self._bar.total))
        self._bar.update(elapsed - self._bar.n)
        self._bar.set_postfix_str(
            f"trials {sum(self._counts.values())} (pruned {self._counts['pruned']}, "
            f"failed {self._counts['failed']}), best {self._best:.0f} samples/s"
        )

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
