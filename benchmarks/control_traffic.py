"""The control traffic of joint tuning: what the ranks say to each other per trial, what
it costs with 2, 4 and 8 ranks here, and a model of its cost at 8 nodes x 8 ranks.

Three parts:

1. **Each exchange alone** (``micro``), under ``torchrun --standalone`` with 2, 4 and 8
   ranks: the messages of a trial, made with autoloader's own objects over its own gloo
   control group (``Ranks``), each repeated ``--repeats`` times after a barrier; an
   exchange's time is its slowest rank's. The exchanges: the checkpoint (one all-reduce
   of 6 floats, every ~50 ms of a trial), the setting broadcast at a trial's start, a
   timing window's estimate (every rank's ``Measurement`` gathered, then rank 0's
   decision broadcast) and the outcomes gathered at a trial's end.
2. **Per trial, in real tuning** (``trials``): ``autoloader.tune()`` of a DDP step, with
   every exchange counted and timed on every rank: on one node with 2, 4 and 8 ranks, and
   on two nodes of 2 ranks (``tests/nodes.py``, where namespaces are permitted).
3. **The model at 8 x 8**: the all-reduce modelled as a ring over p ranks, 2(p-1) steps,
   each as slow as its slowest hop: gloo's cost per step is this machine's where each
   rank has a CPU, and a step that crosses nodes adds a round trip between them. From
   it: the checkpoint's cost at 64 ranks, flat and two-level, and the spacing that would
   keep checkpoints at 1% of the loop (``docs/multi_node.md``).

    python benchmarks/control_traffic.py [--ranks 2 4 8] [--repeats 300]
        [--budget 20] [--json out.json] [--from-json out.json]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests import nodes  # noqa: E402

# Cross-node round trips of small TCP messages to model: a quiet 25-100 Gb/s Ethernet
# fabric (about 50 us), a loaded one or one through a second switch tier (100 us), and a
# cloud network between placement groups (200 us). Gloo's own software cost per step is
# the loopback figure measured here, and is added to each.
CROSS_NODE_SECONDS = (50e-6, 100e-6, 200e-6)
# Share of a trial's time the checkpoints may take.
CHECKPOINT_SHARE = 0.01


def _micro(out: Path, repeats: int) -> None:
    """Under torchrun: time each exchange of a trial; rank 0 writes the figures."""
    from autoloader.distributed._joint import _Measure
    from autoloader.distributed._ranks import Ranks
    from autoloader.measure._deadlines import Deadlines
    from autoloader.measure._lockstep import Checkpoint
    from autoloader.measure._measurement import Measurement

    dist.init_process_group("gloo")
    ranks = Ranks.join()
    assert ranks is not None
    measurement = Measurement(
        samples_per_second=812.5, relative_error=0.03, data_wait_fraction=0.2,
        load_seconds=0.01, step_seconds=0.005, time_to_first_batch=0.4,
        epoch_restart_seconds=None, batches=120, duration=1.6, peak_memory=1 << 30,
        batch_bytes=65536, load_cpu_seconds=0.8, step_cpu_seconds=0.4,
        epochs_samples_per_second=None, burst_left=0,
    )  # fmt: skip
    params = {
        "num_workers": 4, "prefetch_factor": 2, "persistent_workers": True,
        "pin_memory": False, "in_order": True, "worker_kind": "processes",
        "batched_fetch": False, "worker_threads": None,
    }  # fmt: skip
    command = _Measure(params, 2.5, Deadlines.per_batch(0.5, workers=4), None)
    flags = len(dataclasses.fields(Checkpoint))
    exchanges: dict[str, Callable[[], object]] = {
        "checkpoint (all-reduce)": lambda: ranks.maximum([0.0] * flags, during="benchmark"),
        "setting broadcast": lambda: ranks.broadcast(command, during="benchmark"),
        "window (gather + decision)": lambda: (
            ranks.gather(measurement, during="benchmark"),
            ranks.broadcast(False, during="benchmark"),
        ),
        "trial's end (gather)": lambda: ranks.gather(measurement, during="benchmark"),
    }
    figures: dict[str, list[float]] = {}
    for name, exchange in exchanges.items():
        for _ in range(20):  # connections made, caches warm
            exchange()
        seconds = torch.zeros(repeats, dtype=torch.float64)
        for i in range(repeats):
            dist.barrier(group=ranks.group)
            started = time.perf_counter()
            exchange()
            seconds[i] = time.perf_counter() - started
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=ranks.group)  # the slowest rank
        figures[name] = seconds.tolist()
    if ranks.drives:
        out.write_text(
            json.dumps({"ranks": ranks.world_size, "timed": ranks.exchange_seconds, **figures})
        )
    ranks.close()
    dist.destroy_process_group()


class _Counted:
    """Wraps Ranks' exchanges: how many of each, and their seconds, on this rank."""

    def __init__(self) -> None:
        self.count: collections.Counter[str] = collections.Counter()
        self.seconds: collections.defaultdict[str, float] = collections.defaultdict(float)

    def install(self) -> None:
        from autoloader.distributed import _ranks

        for method in ("broadcast", "gather", "maximum"):
            original = getattr(_ranks.Ranks, method)

            def timed(self_: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
                started = time.perf_counter()
                try:
                    return _original(self_, *args, **kwargs)
                finally:
                    label = kwargs.get("during", "?")
                    self.count[label] += 1
                    self.seconds[label] += time.perf_counter() - started

            setattr(_ranks.Ranks, method, timed)


def _trials(out: Path, budget: float) -> None:
    """Under torchrun: tune a DDP step with every exchange counted; each rank writes."""
    import autoloader
    from tests.torchrun_job import DDPStep
    from tests.workloads import SleepDataset

    counted = _Counted()
    counted.install()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dataset = SleepDataset(length=768, latency=0.002)
    called = time.perf_counter()
    result = autoloader.tune(
        dataset,
        DDPStep(),
        batch_size=16,
        time_budget=budget,
        search_space={"num_workers": (0, 4)},
        loader_kwargs={"sampler": torch.utils.data.DistributedSampler(dataset)},
        show_progress=False,
    )
    seconds = time.perf_counter() - called
    report = {
        "rank": rank,
        "seconds": seconds,
        "trials": len(result.trials),
        "trial_seconds": sum(t.duration or 0.0 for t in result.trials),
        "count": counted.count,
        "exchange_seconds": counted.seconds,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _torchrun(ranks: int, *args: str) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={ranks}", "-m", "benchmarks.control_traffic", *args]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")


def _two_nodes(*args: str) -> None:
    with tempfile.TemporaryDirectory() as logs:
        job = nodes.start(["-m", "benchmarks.control_traffic", *args], cwd=Path(logs), env=_env())
        if not job.wait(600) or any(job.returncodes):
            sys.exit(f"the two-node job failed:\n{job.output()[-4000:]}")


def _per_trial(folder: Path) -> dict[str, Any]:
    """Per trial, on the rank that spent most in exchanges."""
    reports = [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))]
    worst = max(reports, key=lambda r: sum(r["exchange_seconds"].values()))
    trials = worst["trials"]
    spent = sum(worst["exchange_seconds"].values())
    return {
        "ranks": len(reports),
        "trials": trials,
        "tune_seconds": worst["seconds"],
        "per_trial": {
            label: (worst["count"][label] / trials, worst["exchange_seconds"][label] / trials)
            for label in sorted(worst["count"], key=lambda k: -worst["exchange_seconds"][k])
        },
        "exchange_seconds": spent,
        "share": spent / worst["seconds"],
    }


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--budget", type=float, default=20.0)
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--from-json", type=Path, help="print the figures of an earlier run")
    args = parser.parse_args()
    if args.from_json:
        report = json.loads(args.from_json.read_text())
        report["micro"] = {int(r): figures for r, figures in report["micro"].items()}
        args.ranks = sorted(report["micro"])
    else:
        report = _run(args)
    _show(report, args.ranks)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


def _run(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {"micro": {}, "trials": {}}
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        for ranks in args.ranks:
            out = work / f"micro{ranks}.json"
            _torchrun(ranks, "micro", str(out), str(args.repeats))
            report["micro"][ranks] = json.loads(out.read_text())
        for ranks in args.ranks:
            folder = work / f"trials{ranks}"
            folder.mkdir()
            _torchrun(ranks, "trials", str(folder), str(args.budget))
            report["trials"][f"1 node x {ranks}"] = _per_trial(folder)
        if nodes.unavailable() is None:
            folder = work / "trials-2x2"
            folder.mkdir()
            _two_nodes("trials", str(folder), str(args.budget))
            report["trials"]["2 nodes x 2"] = _per_trial(folder)
        else:
            print(f"two nodes skipped: {nodes.unavailable()}")
    return report


def _show(report: dict[str, Any], ranks: list[int]) -> None:
    names = [k for k in report["micro"][ranks[0]] if k not in ("ranks", "timed")]
    print("\nEach exchange alone, slowest rank, ms: median (90th percentile)\n")
    print("| exchange | " + " | ".join(f"{r} ranks" for r in ranks) + " |")
    print("|---|" + "---|" * len(ranks))
    for name in names:
        cells = []
        for r in ranks:
            values = report["micro"][r][name]
            cells.append(f"{_ms(statistics.median(values))} "
                         f"({_ms(statistics.quantiles(values, n=10)[-1])})")  # fmt: skip
        print(f"| {name} | " + " | ".join(cells) + " |")
    timed = " | ".join(_ms(report["micro"][r]["timed"]) for r in ranks)
    print(f"| all-reduce timed when the ranks meet | {timed} |")

    print("\nPer trial in real tuning (the rank that spent most in exchanges)\n")
    print("| job | trials | tune s | exchanges per trial: count, ms | in exchanges |")
    print("|---|---|---|---|---|")
    for job, row in report["trials"].items():
        parts = "; ".join(
            f"{label}: {count:.1f}, {_ms(seconds)}"
            for label, (count, seconds) in row["per_trial"].items()
        )
        print(f"| {job} | {row['trials']} | {row['tune_seconds']:.1f} | {parts} | "
              f"{row['share']:.2%} |")  # fmt: skip

    # The model. A ring all-reduce over p ranks is 2(p-1) steps, each as slow as its
    # slowest hop. Per step, gloo's own cost is taken from the largest job here whose
    # ranks each had a CPU (more ranks than CPUs wait for a core at every step: that is
    # this VM, not the protocol), and a node-crossing hop adds a round trip between nodes.
    cpus = len(os.sched_getaffinity(0))
    fitting = [r for r in ranks if r <= cpus] or [min(ranks)]
    base = max(fitting)
    step = statistics.median(report["micro"][base]["checkpoint (all-reduce)"]) / (2 * (base - 1))
    print(f"\nper ring step of gloo here, {base} ranks on {cpus} CPUs: {step * 1e6:.0f} us")
    print("\nModel at 8 nodes x 8 ranks, one CPU or more per rank: the checkpoint's all-reduce")
    print("flat (one ring of 64: 126 steps, each crossing nodes somewhere) and two-level")
    print("(each node's 8 ranks, then the 8 nodes' first ranks, then back: 14 + 14 + 3 steps,")
    print("14 of them crossing nodes), and the spacing that keeps it at 1% of the loop\n")
    print("| round trip between nodes | flat | spacing at 1% | two-level | spacing at 1% |")
    print("|---|---|---|---|---|")
    model = []
    for cross in CROSS_NODE_SECONDS:
        flat = 126 * (step + cross)
        two_level = 17 * step + 14 * (step + cross)
        model.append({"cross": cross, "flat": flat, "two_level": two_level})
        print(f"| {cross * 1e6:.0f} us | {_ms(flat)} ms | {flat / CHECKPOINT_SHARE:.1f} s | "
              f"{_ms(two_level)} ms | {two_level / CHECKPOINT_SHARE:.1f} s |")  # fmt: skip
    report["model"] = {"per_step": step, "rows": model}


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "micro":
        _micro(Path(sys.argv[2]), int(sys.argv[3]))
    elif len(sys.argv) > 1 and sys.argv[1] == "trials":
        _trials(Path(sys.argv[2]), float(sys.argv[3]))
    else:
        main()
