"""The ``autoloader`` command: a thin layer that parses, calls the library and prints."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from autoloader._exceptions import AutoloaderError
from autoloader._report import summary


def _demo(args: argparse.Namespace) -> int:
    from autoloader._demo import SleepStep, SyntheticImageDataset
    from autoloader._tune import tune

    dataset = SyntheticImageDataset(args.items, read_latency=args.read_latency)
    print(
        f"Tuning a DataLoader for a synthetic image dataset ({args.items} items, "
        f"{args.read_latency * 1000:.0f} ms read latency + CPU transform) and a "
        f"{args.step_time * 1000:.0f} ms step, batch size {args.batch_size}, "
        f"for up to {args.time_budget:.0f} s...",
        flush=True,
    )
    result = tune(
        dataset,
        SleepStep(args.step_time),
        batch_size=args.batch_size,
        time_budget=args.time_budget,
        loader_kwargs={"shuffle": True},
        show_progress=not args.quiet,
    )
    ceiling = args.batch_size / args.step_time
    print(summary(result))
    print(f"step-bound ceiling (batch_size / step time): {ceiling:,.0f} samples/s")
    path = result.save(args.out)
    print(f"saved to {path}; load it with autoloader.load({str(path)!r}).make_loader(dataset)")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autoloader",
        description="Find the fastest safe PyTorch DataLoader settings on this machine.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log every trial")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="tune a built-in synthetic workload and print the result",
        description="Tune a built-in workload (latency-bound reads plus a CPU transform, "
        "a 10 ms step), print the best settings against num_workers=0, write the JSON.",
    )
    demo.add_argument(
        "--time-budget",
        type=float,
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
        type=float,
        default=0.004,
        metavar="S",
        help="seconds each item's read waits (default: 0.004)",
    )
    demo.add_argument(
        "--step-time",
        type=float,
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(message)s",
    )
    try:
        code: int = args.handler(args)
    except AutoloaderError as error:
        print(f"autoloader: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("autoloader: interrupted", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
