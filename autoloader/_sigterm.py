"""SIGTERM while ``tune()`` runs: stop as Ctrl-C stops, keep what was measured, then let
the signal do what it would have done.

NOTE [ SIGTERM while tuning ]
SLURM, Kubernetes and torchrun stop a job with SIGTERM (and SIGKILL after a grace
period). Left to its default, SIGTERM ends the process on the spot: every trial of a
``tune()`` under way is lost, its workers orphaned. While ``tune()`` runs in the main
thread, :func:`sigterm_while_tuning` holds SIGTERM instead:

1. The first SIGTERM raises :class:`~autoloader.search._driver.Terminated`, a
   KeyboardInterrupt, and notes itself in the run's ``Interruption``: the trial under
   way stops and its workers are killed as on Ctrl-C, recorded "interrupted
   (SIGTERM)" (the note stops the search even where the exception itself is lost in a
   ``__del__``). Later SIGTERMs are only counted: the run is already stopping, and the
   saving must not be cut short; so are those that come once the run has its result
   (:meth:`Sigterm.hold`).
2. Once the baseline finished, ``tune()`` comes to the best of the finished trials
   (``partial=True``, so that ``path=`` never reuses it as a complete result) and saves
   it at ``path``, atomically (``TuneResult.save``). Before the baseline there is
   nothing to keep: the KeyboardInterrupt goes on.
3. On the way out, the handler that was there before is put back (the same object) and
   SIGTERM is delivered again (``signal.raise_signal``), so that it does what it would
   have done without autoloader, only later: the default handler ends the process by
   SIGTERM (exit status -15, 143 in a shell), the conventional status a job scheduler
   reads; a handler of the program's own runs once, as if the signal had just come. If
   it returns, ``tune()`` returns the partial result (or, before the baseline, raises
   the KeyboardInterrupt). A SIGTERM the program ignores (``SIG_IGN``), or a handler
   not installed from Python, is left alone: nothing is installed.

Under torchrun, SIGTERM is torchrun stopping every rank of the job: it becomes a
:class:`~autoloader.RankError` at once, with no partial result (the ranks could not
agree on one; a ``storage`` keeps the finished trials).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType

from autoloader._exceptions import RankError
from autoloader.distributed import Ranks
from autoloader.search import Interruption, Terminated


class Sigterm:
    """What SIGTERM did during one ``tune()``: :attr:`interruption` (the run's, which
    Ctrl-C notes too) and :attr:`received` (whether it came, to be delivered again)."""

    def __init__(self) -> None:
        self.interruption = Interruption()
        self.received = False
        self._holding = False

    def hold(self) -> None:
        """The run has its result: a SIGTERM from now on waits until it is saved."""
        self._holding = True

    def handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = True
        if self._holding or self.interruption.is_set():
            return  # already stopping, or done: delivered again on the way out
        self.interruption.note("SIGTERM")
        raise Terminated("stopped by SIGTERM while tuning")


@contextlib.contextmanager
def sigterm_while_tuning(ranks: Ranks | None) -> Iterator[Sigterm]:
    """SIGTERM held for one ``tune()`` in this process (``ranks`` is ``None``), or made
    a :class:`RankError` under torchrun; see ``NOTE [ SIGTERM while tuning ]``. Off the
    main thread (where Python runs signal handlers) nothing is installed."""
    sigterm = Sigterm()
    previous = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or (
        ranks is None and previous in (signal.SIG_IGN, None)
    ):
        yield sigterm
        return
    signal.signal(signal.SIGTERM, sigterm.handle if ranks is None else _rank_error(ranks))
    try:
        yield sigterm
    finally:
        signal.signal(signal.SIGTERM, previous)
        if sigterm.received:
            signal.raise_signal(signal.SIGTERM)


def _rank_error(ranks: Ranks) -> Callable[[int, FrameType | None], None]:
    """Under torchrun, SIGTERM as a :class:`RankError`.

    torchrun stops every rank with SIGTERM when one of them fails (or dies); by default
    the process would end on the spot, its trial's workers orphaned and no word of why.
    Raised instead, the error unwinds the trial (its workers stopped) and says what
    happened.
    """

    def handle(signum: int, frame: FrameType | None) -> None:
        raise RankError(
            f"rank {ranks.rank} was stopped (SIGTERM) while tuning: torchrun stops every "
            "rank when the job is interrupted (Ctrl-C) or a rank fails or dies; the first "
            "error in the job's output says which"
        )

    return handle
