"""The ``autoloader`` command: a thin layer that parses, calls the library and prints.

Library errors (:class:`~autoloader.AutoloaderError`) become one line on stderr and exit
status 1; usage errors, including a ``MODULE:NAME`` that cannot be imported, exit 2
(argparse's convention). ``tune`` and ``demo`` check ``--out`` before the first trial;
stopped by SIGTERM, they save the finished trials there and exit with 143 (128 + 15, as a
shell reports a process ended by SIGTERM); Ctrl-C before the baseline exits with 130.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import io
import logging
import os
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler

from autoloader._exceptions import AutoloaderError
from autoloader._problem import DEFAULT_TIME_BUDGET, TuneArguments
from autoloader.checks import ISOLATIONS

if TYPE_CHECKING:
    from autoloader.results import TuneResult

# The exit status of a run stopped by SIGTERM, and of one stopped by Ctrl-C.
_SIGTERM_STATUS = 128 + signal.SIGTERM
_SIGINT_STATUS = 128 + signal.SIGINT


def _tune(args: argparse.Namespace) -> int:
    from autoloader._tune import tune
    from autoloader.results import report

    out = _checked_out(args.out)  # before the dataset is built, or any trial
    dataset = factory = args.dataset
    if not isinstance(dataset, Dataset) and callable(factory):
        try:  # a factory: the dataset is built here, not at import
            dataset = factory()
        except Exception as error:
            name = getattr(factory, "__qualname__", "the dataset factory")
            raise AutoloaderError(f"{name}() raised {type(error).__name__}: {error}") from error
    loader_kwargs: dict[str, Any] | None = {"shuffle": True} if args.shuffle else None
    if dist.is_initialized():  # under torchrun: each rank reads its share, as in training
        loader_kwargs = {"sampler": DistributedSampler(dataset, shuffle=args.shuffle)}
    arguments = TuneArguments(
        # The options named as tune()'s arguments, as they are (NOTE [ The CLI's options ]).
        **{name: value for name, value in vars(args).items() if name in _TUNE_DEFAULTS},
        loader_kwargs=loader_kwargs,
        show_progress=not args.quiet,
    )
    result, path, code = _tuned_and_saved(
        lambda: tune(dataset, args.step, **arguments.as_kwargs()), out
    )
    if path is None or (dist.is_initialized() and dist.get_rank() != 0):
        return code  # every rank holds the same result: rank 0 saves and prints it
    print(report(result))
    print(f"\nsaved to {path}: autoloader.load({str(path)!r}).make_loader(dataset)")
    if result.params.get("step_threads") is not None:
        print("and, where the step trains: autoloader.load(...).apply_threads()")
    return code


def _checked_out(out: str) -> Path:
    """``--out``, refused before any trial where the result could not be written
    there: a folder, a file that is not an autoloader result (``tune(path=...)``'s
    guard), a place this process cannot create a file in. Under torchrun only rank 0
    writes it, and checks it."""
    from autoloader._problem import check_result_path

    try:
        path = check_result_path(out, writes=not dist.is_initialized() or dist.get_rank() == 0)
    except AutoloaderError as error:
        raise AutoloaderError(f"--out: {error}") from None
    assert path is not None  # out is a str
    return path


def _tuned_and_saved(
    run: Callable[[], TuneResult], out: Path
) -> tuple[TuneResult, Path | None, int]:
    """``run()``'s result, saved at ``out`` (the path written, ``None`` on a rank that
    does not write), and the exit status: 143 where SIGTERM stopped the run.

    Saved before the report prints: a report that fails to print (a closed pipe) loses
    nothing measured.

    Raises:
        AutoloaderError: the file could not be written; the report is printed first,
            so that the settings are not lost.
    """
    from autoloader.results import report

    with _sigterm_noted() as terminated:
        result = run()
        try:
            path = result.save(out)
        except (OSError, ValueError) as error:  # ValueError: a figure JSON cannot hold
            print(report(result))
            raise AutoloaderError(
                f"could not write the result to {out}: {error}; its settings are above"
            ) from None
    if not terminated.is_set():
        return result, path, 0
    if path is not None:
        print(
            f"autoloader: stopped by SIGTERM; the best of the finished trials is saved to {path}",
            file=sys.stderr,
        )
    return result, path, _SIGTERM_STATUS


@contextlib.contextmanager
def _sigterm_noted() -> Iterator[threading.Event]:
    """SIGTERM noted in the event, not acted on at once, while the run and its saving
    last.

    ``tune()`` holds SIGTERM itself (``NOTE [ SIGTERM while tuning ]``): it stops the
    trials, comes to its partial result, and delivers SIGTERM again to the handler that
    was there before it, this one, which notes it and returns, so that ``tune()``
    returns the result for the command to save. A SIGTERM in the moment before
    ``tune()`` holds it, or while the file is written, is noted too: the command ends
    with 143 once the result is saved.
    """
    terminated = threading.Event()
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(
        signal.SIGTERM
    ) in (signal.SIG_IGN, None):
        yield terminated
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: terminated.set())
    try:
        yield terminated
    finally:
        signal.signal(signal.SIGTERM, previous)


def _show(args: argparse.Namespace) -> int:
    from autoloader.results import load, report

    print(report(load(args.result)))
    return 0


def _plot(args: argparse.Namespace) -> int:
    from autoloader.results import load, plot

    result = load(args.result)
    try:
        plot(result, args.output)
    except ImportError as error:
        raise AutoloaderError(str(error)) from None
    print(f"wrote {args.output}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from autoloader._demo import SleepStep, SyntheticImageDataset
    from autoloader._tune import tune
    from autoloader.results import report

    out = _checked_out(args.out)
    dataset = SyntheticImageDataset(args.items, read_latency=args.read_latency)
    print(
        f"Tuning a DataLoader for a synthetic image dataset ({args.items} items, "
        f"{args.read_latency * 1000:.0f} ms read latency + CPU transform) and a "
        f"{args.step_time * 1000:.0f} ms step, batch size {args.batch_size}, "
        f"for up to {args.time_budget:.0f} s...",
        flush=True,
    )
    result, path, code = _tuned_and_saved(
        lambda: tune(
            dataset,
            SleepStep(args.step_time),
            batch_size=args.batch_size,
            time_budget=args.time_budget,
            loader_kwargs={"shuffle": True},
            show_progress=not args.quiet,
        ),
        out,
    )
    print(report(result))
    print(f"\nsaved to {path}; load it with autoloader.load({str(path)!r}).make_loader(dataset)")
    return code


def _seconds(text: str, *, zero: bool = False) -> float:
    """An option's seconds (``--time-budget``): a finite number, positive (or 0 where
    ``zero``), at most a week (``NOTE [ The longest time ]``).

    Raises:
        argparse.ArgumentTypeError: naming the value and the bounds.
    """
    from autoloader._exceptions import InvalidInputError
    from autoloader.checks import check_seconds

    try:
        return check_seconds("it", float(text), zero=zero)
    except ValueError as error:  # InvalidInputError is one
        if not isinstance(error, InvalidInputError):
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
        raise argparse.ArgumentTypeError(str(error)) from None


def _seconds_or_zero(text: str) -> float:
    return _seconds(text, zero=True)


def import_object(spec: str) -> Any:
    """``"package.module:name"`` or ``"path/to/file.py:name"`` to the object it names.

    Raises:
        argparse.ArgumentTypeError: the spec is malformed or does not import.
    """
    module_name, colon, name = spec.rpartition(":")
    if not colon or not module_name or not name.isidentifier():
        raise argparse.ArgumentTypeError(
            f"{spec!r} is not MODULE:NAME (e.g. my_data:make_dataset or train.py:step)"
        )
    try:
        if module_name.endswith(".py"):
            path = Path(module_name).resolve()
            if not path.is_file():
                raise argparse.ArgumentTypeError(f"{module_name}: no such file")
            # Importable by name too, so that spawned workers can unpickle its objects.
            sys.path.insert(0, str(path.parent))
            module = importlib.import_module(path.stem)
        else:
            if "" not in sys.path and str(Path.cwd()) not in sys.path:
                sys.path.insert(0, str(Path.cwd()))
            module = importlib.import_module(module_name)
    except argparse.ArgumentTypeError:
        raise
    except Exception as error:  # the user's module raised while importing
        raise argparse.ArgumentTypeError(
            f"cannot import {module_name!r}: {type(error).__name__}: {error}"
        ) from None
    try:
        return getattr(module, name)
    except AttributeError:
        raise argparse.ArgumentTypeError(f"{module_name!r} has no {name!r}") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autoloader",
        description="Find the fastest safe PyTorch DataLoader settings on this machine.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log every trial")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_tune(commands)
    _add_show(commands)
    _add_plot(commands)
    _add_demo(commands)
    return parser


# NOTE [ The CLI's options ]
# An option of ``autoloader tune`` named as an argument of tune() (by its dest:
# --batch-size is batch_size) is passed to it as it is, and has tune()'s own default,
# read from TuneArguments where it is not argparse's None (tests/test_signatures.py
# checks them all); --time-budget's help says what tune()'s None means. The other
# options (--out, --shuffle, --quiet) are the command's own.
_TUNE_DEFAULTS = {field.name: field.default for field in dataclasses.fields(TuneArguments)}


def _add_tune(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    tune = commands.add_parser(
        "tune",
        help="tune the DataLoader settings for your dataset and step",
        description="Tune DataLoader settings for a dataset and training step named as "
        "MODULE:NAME (a module on the path, or a .py file), print the report and save "
        "the result as JSON.",
        epilog="example: autoloader tune my_data:make_dataset train.py:step --batch-size 64",
    )
    tune.add_argument(
        "dataset",
        type=import_object,
        metavar="MODULE:DATASET_FACTORY",
        help="a function that returns the Dataset (called with no arguments), or a Dataset",
    )
    tune.add_argument(
        "step",
        type=import_object,
        metavar="MODULE:STEP",
        help="the training step: a function that receives one batch",
    )
    tune.add_argument(
        "--batch-size", type=int, required=True, metavar="N", help="samples per batch"
    )
    tune.add_argument(
        "--time-budget",
        type=_seconds,
        default=_TUNE_DEFAULTS["time_budget"],
        metavar="S",
        help=f"seconds the tuning may take (default: {DEFAULT_TIME_BUDGET:g})",
    )
    tune.add_argument(
        "--n-trials", type=int, metavar="N", help="cap on search trials (default: none)"
    )
    tune.add_argument(
        "--memory-budget",
        metavar="SIZE",
        help="memory the process tree may use, e.g. 6GiB (default: a safe share of what is free)",
    )
    tune.add_argument(
        "--out",
        default="best.json",
        metavar="PATH",
        help="where to write the result (default: best.json)",
    )
    tune.add_argument(
        "--storage",
        metavar="URL",
        help="keep the study in a journal file or an Optuna storage URL (sqlite:///t.db) "
        "so that an interrupted run resumes; watch it with optuna-dashboard",
    )
    tune.add_argument("--shuffle", action="store_true", help="shuffle, as in training")
    tune.add_argument("--device", help="move each batch there before the step, e.g. cuda")
    tune.add_argument(
        "--seed",
        type=int,
        default=_TUNE_DEFAULTS["seed"],
        help="the sampler's seed (default: %(default)s)",
    )
    tune.add_argument(
        "--isolation",
        choices=ISOLATIONS,
        default=_TUNE_DEFAULTS["isolation"],
        help="run each trial in its own process to survive crashes (default: %(default)s)",
    )
    tune.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    tune.set_defaults(handler=_tune)


def _add_show(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    show = commands.add_parser(
        "show",
        help="print the report of a saved result",
        description="Print the report of a result saved by tune: the settings against "
        "the defaults, the speedup, the bottleneck and advice.",
    )
    show.add_argument("result", metavar="RESULT.json")
    show.set_defaults(handler=_show)


def _add_plot(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    plot = commands.add_parser(
        "plot",
        help="draw a saved result's trials to an image",
        description="Draw samples/s against num_workers for each prefetch_factor, with the "
        "step's ceiling and the baseline, and the search history (needs matplotlib).",
    )
    plot.add_argument("result", metavar="RESULT.json")
    plot.add_argument(
        "-o",
        "--output",
        default="tuning.png",
        metavar="PATH",
        help="image to write; the format follows the suffix (default: tuning.png)",
    )
    plot.set_defaults(handler=_plot)


def _add_demo(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    demo = commands.add_parser(
        "demo",
        help="tune a built-in synthetic workload and print the result",
        description="Tune a built-in workload (latency-bound reads plus a CPU transform, "
        "a 10 ms step), print the report, write the JSON.",
    )
    demo.add_argument(
        "--time-budget",
        type=_seconds,
        default=30.0,
        metavar="S",
        help="seconds for the tuning run (default: 30)",
    )
    demo.add_argument(
        "--batch-size", type=int, default=16, metavar="N", help="samples per batch (default: 16)"
    )
    demo.add_argument(
        "--items", type=int, default=4096, metavar="N", help="items in the dataset (default: 4096)"
    )
    demo.add_argument(
        "--read-latency",
        type=_seconds_or_zero,
        default=0.004,
        metavar="S",
        help="seconds each item's read waits (default: 0.004)",
    )
    demo.add_argument(
        "--step-time",
        type=_seconds_or_zero,
        default=0.01,
        metavar="S",
        help="seconds each training step takes (default: 0.01)",
    )
    demo.add_argument(
        "--out",
        default="autoloader-demo.json",
        metavar="PATH",
        help="where to write the result (default: autoloader-demo.json)",
    )
    demo.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    demo.set_defaults(handler=_demo)


def _warning_line(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    line: str | None = None,
) -> str:
    return f"autoloader: warning: {message}\n"


# The commands that tune, and so join a torchrun job; the others (show, plot) only read
# a file, and never wait for other ranks, whatever RANK and WORLD_SIZE say.
_TUNING_COMMANDS = frozenset({"tune", "demo"})


def _command(argv: Sequence[str]) -> str | None:
    """The command named in ``argv``: its first word that is not an option (the options
    before the command take no value)."""
    return next((word for word in argv if not word.startswith("-")), None)


def _join_torchrun() -> None:
    """Under torchrun (``RANK`` and ``WORLD_SIZE`` set for a world of more than one),
    start the process group before the user's modules are imported, so that a step
    that builds a DDP model finds it: gloo, with NCCL for CUDA tensors where there is
    a GPU. autoloader's own exchanges go through a gloo group of their own.

    Raises:
        InvalidInputError: ``WORLD_SIZE``, ``RANK`` or ``MASTER_PORT`` is not a number
            in its range, or the rendezvous lacks a variable (``MASTER_ADDR``).
    """
    from autoloader._exceptions import InvalidInputError
    from autoloader.checks import env_int

    if dist.is_initialized() or "RANK" not in os.environ:
        return
    size = env_int(
        "WORLD_SIZE", default=1, least=1, why="torchrun sets it: the number of ranks in the job"
    )
    if size < 2:
        return
    env_int("RANK", default=0, least=0, most=size - 1, why="torchrun sets it: this rank")
    env_int("MASTER_PORT", default=1, least=1, most=65535, why="torchrun sets it: rank 0's port")
    import torch

    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    try:
        dist.init_process_group(backend)
    except ValueError as error:  # torch's env:// rendezvous: MASTER_ADDR missing...
        raise InvalidInputError(
            f"RANK and WORLD_SIZE ({size}) are set, but the ranks cannot meet: {error}. Run "
            "under torchrun, which sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, or "
            "unset RANK and WORLD_SIZE to tune alone."
        ) from None


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if _command(argv) in _TUNING_COMMANDS:
        try:
            _join_torchrun()
        except AutoloaderError as error:
            print(f"autoloader: error: {error}", file=sys.stderr)
            return 1
    args = _parser().parse_args(argv)
    if isinstance(sys.stdout, io.TextIOWrapper):
        # A string read from a file or an error may hold what stdout cannot encode (a
        # lone surrogate from a "\ud800" escape): shown escaped, not a crash.
        sys.stdout.reconfigure(errors="backslashreplace")
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(message)s",
    )
    warnings.formatwarning = _warning_line
    try:
        code: int = args.handler(args)
    except AutoloaderError as error:
        print(f"autoloader: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as error:
        from autoloader.search import Terminated

        if isinstance(error, Terminated):  # before the baseline: nothing measured to save
            print("autoloader: stopped by SIGTERM before the baseline ended", file=sys.stderr)
            return _SIGTERM_STATUS
        print("autoloader: interrupted", file=sys.stderr)
        return _SIGINT_STATUS
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
