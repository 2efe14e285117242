from __future__ import annotations

import multiprocessing
import pickle
from typing import Any

import pytest
import torch

from autoloader.loader._factory import build_loader, merge_loader_kwargs
from autoloader.loader._params import normalize_params
from autoloader.loader._worker_threads import LimitThreads

from .workloads import ThreadsInWorker, WorkerMarks, mark_worker


def _reports(dataset: Any, method: str, **params: Any) -> torch.Tensor:
    fixed = {"multiprocessing_context": multiprocessing.get_context(method)}
    options = merge_loader_kwargs(normalize_params(params), batch_size=1, fixed=fixed)
    loader = build_loader(dataset, options)
    try:
        return torch.cat(list(loader))
    finally:
        del loader


@pytest.mark.parametrize("method", ["fork", "spawn"])
@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_worker_threads_limit_every_native_pool_inside_workers(method: str) -> None:
    limited = _reports(ThreadsInWorker(), method, num_workers=2, worker_threads=1)
    # Each row: BLAS pool threads, torch threads, OMP_NUM_THREADS, in one worker.
    assert limited.tolist() == [[1, 1, 1]] * 8


def test_without_worker_threads_the_blas_pool_is_as_wide_as_the_machine() -> None:
    from threadpoolctl import threadpool_info

    blas = max(p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas")
    if blas < 2:
        pytest.skip("this machine's BLAS pool has one thread: nothing to limit")
    free = _reports(ThreadsInWorker(), "fork", num_workers=2)
    assert set(free[:, 0].tolist()) == {blas}


@pytest.mark.parametrize("method", ["fork", "spawn"])
@pytest.mark.slow  # over 2.5 s here: the full suite's (docs/development/checks.md)
def test_the_users_worker_init_fn_still_runs(method: str) -> None:
    fixed = {"worker_init_fn": mark_worker, "multiprocessing_context": method}
    params = normalize_params({"num_workers": 2, "worker_threads": 1})
    loader = build_loader(WorkerMarks(), merge_loader_kwargs(params, batch_size=1, fixed=fixed))
    try:
        assert sorted(int(b) for b in loader) == [0, 0, 1, 1]
    finally:
        del loader


def test_limit_threads_pickles_for_spawned_workers() -> None:
    again = pickle.loads(pickle.dumps(LimitThreads(2, mark_worker)))
    assert again.threads == 2 and again.then is mark_worker
