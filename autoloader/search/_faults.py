"""What a failed trial's error means, and what the user should do about it.

A setting that crashes its workers, exhausts shared memory or file descriptors, or hangs
is recorded with a reason a person can act on; the tuning run goes on.
"""

from __future__ import annotations

import dataclasses
import errno
import re
import shutil
import signal
from collections.abc import Mapping
from typing import Any

from autoloader.checks import world
from autoloader.measure import (
    FIRST_STEP_STAGE,
    FIRST_STEP_TIMEOUT,
    TrialError,
    TrialProcessDied,
    TrialTimeout,
    exception_chain,
    format_bytes,
    is_oom_error,
)
from autoloader.search._outcome import Failed, FaultKind, Pruned, PruneKind

_SIGNAL_NAMES = {signal.strsignal(s): s.name for s in signal.Signals if signal.strsignal(s)}
_KILLED_BY = re.compile(r"is killed by signal: (?P<name>[^.]+)\.")
_SHM = "/dev/shm"


def _signal_of(error: TrialError) -> str | None:
    """The signal that killed a worker (or the trial's process): from its exit code,
    else from torch's message."""
    code = error.error.exit_code if isinstance(error.error, TrialProcessDied) else None
    if code is not None and code < 0:
        return signal.Signals(-code).name
    if error.worker_signals:
        return signal.Signals(error.worker_signals[0]).name
    for link in exception_chain(error.error):
        match = _KILLED_BY.search(str(link))
        if match:
            return _SIGNAL_NAMES.get(match["name"], match["name"])
    return None


def _has_errno(error: BaseException, number: int, text: str) -> bool:
    for link in exception_chain(error):
        if isinstance(link, OSError) and link.errno == number:
            return True
        if text in str(link):
            return True
    return False


def _in_flight(params: Mapping[str, Any]) -> int:
    return int(params["num_workers"]) * int(params.get("prefetch_factor") or 0)


def _shm_advice(params: Mapping[str, Any], batch_bytes: int | None) -> str:
    try:
        usage = shutil.disk_usage(_SHM)
        space = f"{_SHM} has {format_bytes(usage.free)} free of {format_bytes(usage.total)}"
    except OSError:
        space = f"{_SHM} could not be read"
    batches = _in_flight(params)
    _, _, local_ranks = world()  # under torchrun, every rank of the node shares /dev/shm
    load = ""
    if batch_bytes:
        on_node = f" on each of the {local_ranks} ranks of this node" if local_ranks > 1 else ""
        load = (
            f"; this setting keeps up to {batches} batches of {format_bytes(batch_bytes)} "
            f"in flight{on_node} ({format_bytes(local_ranks * batches * batch_bytes)})"
        )
    return (
        f"{space}{load}. Use fewer workers or a smaller prefetch_factor, or give the "
        f"container more shared memory (docker run --shm-size=...)"
    )


def _open_files_advice() -> str:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return (
        f"raise the limit (ulimit -n, now {soft}) or share tensors through files: "
        "torch.multiprocessing.set_sharing_strategy('file_system')"
    )


def classify(
    error: TrialError, *, params: Mapping[str, Any], batch_bytes: int | None = None
) -> Pruned | Failed:
    """The outcome to record for a trial that ended with ``error``: its kind, and a
    reason that starts with the kind, says what to do, and names the rank it happened
    on under torchrun.
    """
    outcome = _classify(error, params=params, batch_bytes=batch_bytes)
    if error.rank is None:
        return outcome
    return dataclasses.replace(outcome, reason=f"{outcome.reason} (on rank {error.rank})")


def _classify(
    error: TrialError, *, params: Mapping[str, Any], batch_bytes: int | None
) -> Pruned | Failed:
    """See :func:`classify`.

    A worker's death is named before a timeout: a worker killed at the wrong moment can
    leave the others and the DataLoader waiting on a lock it held, and the hang that
    follows is only its consequence.
    """
    cause = error.error
    peak = error.peak_memory

    def _failed(kind: FaultKind, reason: str) -> Failed:
        return Failed(kind, reason, peak_memory=peak)

    if is_oom_error(cause):
        return Pruned(PruneKind.MEMORY, f"memory: {error.summary}", peak_memory=peak)
    name = _signal_of(error)
    who = "the trial's process" if isinstance(cause, TrialProcessDied) else "a worker"
    if name == "SIGKILL":
        return Pruned(
            PruneKind.KILLED,
            f"killed: {who} was killed (SIGKILL), likely by the kernel's OOM killer; "
            "use fewer workers or a smaller prefetch_factor, or set memory_budget",
            peak_memory=peak,
        )
    if name == "SIGBUS" or _has_errno(cause, errno.ENOSPC, "No space left on device"):
        what = f"{who} crashed (SIGBUS)" if name == "SIGBUS" else error.summary
        return _failed(
            FaultKind.SHARED_MEMORY, f"shared memory: {what}. {_shm_advice(params, batch_bytes)}"
        )
    if isinstance(cause, TrialProcessDied):
        if name is not None:
            return _failed(
                FaultKind.PROCESS_DIED, f"trial process crashed ({name}) with this setting"
            )
        if cause.exit_code is None:
            return _failed(
                FaultKind.PROCESS_DIED,
                f"trial process ended with this setting, its exit code lost: {cause.lost_to}",
            )
        return _failed(FaultKind.PROCESS_DIED, f"trial process exited with code {cause.exit_code}")
    if name is not None:
        return _failed(FaultKind.WORKER_CRASHED, f"worker crashed ({name})")
    if isinstance(cause, TrialTimeout):
        return _failed(
            FaultKind.TIMEOUT, f"timeout: {cause}; a worker or step_fn hangs with this setting"
        )
    if _has_errno(cause, errno.EMFILE, "Too many open files"):
        return _failed(
            FaultKind.OPEN_FILES, f"too many open files: {error.summary}; {_open_files_advice()}"
        )
    if error.worker_exit_codes:
        return _failed(
            FaultKind.WORKER_CRASHED, f"worker exited with code {error.worker_exit_codes[0]}"
        )
    return _failed(FaultKind.ERROR, f"{error.summary} (while {error.stage})")


def baseline_advice(error: TrialError) -> str:
    """What to do about the baseline's ``error``: a first step that overran its deadline
    may be a set-up that takes longer than the budget allows (``NOTE [ The first
    step ]``); anything else is a fault in the user's code."""
    timeout = error.error
    if isinstance(timeout, TrialTimeout) and timeout.stage == FIRST_STEP_STAGE:
        return (
            "A step's first call may take the time budget, and at least "
            f"{FIRST_STEP_TIMEOUT:.0f} s, for its one-time set-up (a model built on first "
            "use, DDP, torch.compile): if yours takes longer, raise time_budget; if it "
            "blocks, fix it and tune again."
        )
    return (
        "This is a fault in the dataset, collate_fn or step_fn, not in a loader setting; "
        "fix it and tune again."
    )
