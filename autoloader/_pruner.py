"""Stop trials whose settings are clearly worse than the best found so far."""

from __future__ import annotations

from typing import TYPE_CHECKING

import optuna
from optuna.trial import TrialState

if TYPE_CHECKING:
    from optuna.trial import FrozenTrial


class ClearlyWorsePruner(optuna.pruners.BasePruner):
    """Prune a trial whose running value is below ``ratio`` times the best complete trial.

    Median-style pruners compare trials step by step and cut anything below the middle,
    which on a noisy machine cuts settings within noise of the best. Throughput
    trials only need to stop what is *clearly* worse, and a throughput estimate is
    comparable at any step, so this compares the latest value to the best final one.

    Args:
        ratio (float, optional): fraction of the best value under which a trial is
            pruned. (default: ``0.6``)
        n_warmup_steps (int, optional): reports to wait for before pruning, so the
            estimate has settled. (default: ``2``)
    """

    def __init__(self, *, ratio: float = 0.6, n_warmup_steps: int = 2) -> None:
        if not 0.0 < ratio < 1.0:
            raise ValueError(f"ratio must be between 0 and 1 but got {ratio}.")
        if n_warmup_steps < 1:
            raise ValueError(f"n_warmup_steps must be at least 1 but got {n_warmup_steps}.")
        self._ratio = ratio
        self._n_warmup_steps = n_warmup_steps

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        step = trial.last_step
        if step is None or step < self._n_warmup_steps:
            return False
        complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        values = [t.value for t in complete if t.value is not None]
        if not values:
            return False
        return trial.intermediate_values[step] < self._ratio * max(values)
