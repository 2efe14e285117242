"""Under torchrun: the joint choice against the single-process choice copied to every
rank, and against Lightning's heuristic, measured side by side on every rank at once.

For each number of ranks per node N (``--ranks 2 4``), on one machine, or on
``--nodes 2`` nodes of N ranks each (``tests/nodes.py``: each node's torchrun agent in
a UTS namespace of its own, sharing this machine):

1. ``autoloader.tune()`` in one process alone (no torchrun): the choice a user would
   make before launching the job and then copy to every rank;
2. ``autoloader.tune()`` under ``torchrun --nproc_per_node=N``, every rank tuning
   together (the joint choice);
3. Lightning's heuristic, ``num_workers = max(1, cpus // N - 1)``
   (``lightning.fabric.utilities.data.suggested_max_num_workers``), DataLoader's defaults
   otherwise;
4. the three settings measured under torchrun, N ranks at once, interleaved
   (A B C, B C A, C A B ...) for ``--rounds`` rounds: each measurement builds the
   loader over the dataset tuned on, runs one epoch untimed (worker start-up and its
   burst), then times ``--epochs`` epochs of the DDP loop, as training runs them (the
   workers' restart, for a setting without persistent workers, and each epoch's drain
   and refill included). A DDP step waits for every rank, so the job runs at its
   slowest rank's pace: the figure is that rank's samples per second (the job's is N
   times it).

The workload: each item costs 1.5 ms of Python CPU work (a decode) and waits 3 ms (a
read from remote storage); batches of 16; a DDP step (an MLP on the CPU, gloo) that
also waits 5 ms, as for an accelerator.

    python benchmarks/torchrun_joint.py [--ranks 2 4] [--nodes 1] [--time-budget 30]
        [--rounds 3] [--epochs 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests import nodes  # noqa: E402

BATCH_SIZE = 16
CPU_SECONDS = 0.0015
LATENCY = 0.003
STEP_WAIT = 0.005


class DecodeAndRead(Dataset[torch.Tensor]):
    """An item is 1.5 ms of CPU work in Python and a 3 ms wait."""

    def __init__(self, length: int = 4096) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        until = time.process_time() + CPU_SECONDS
        while time.process_time() < until:
            pass
        time.sleep(LATENCY)
        return torch.full((32,), float(index % 11))


class Step:
    """A DDP step on the CPU (when a process group exists), then a 5 ms wait."""

    def __init__(self) -> None:
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None

    def __call__(self, batch: torch.Tensor) -> None:
        if self.model is None:
            model = torch.nn.Sequential(
                torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1)
            )
            if dist.is_initialized():
                model = torch.nn.parallel.DistributedDataParallel(model)
            self.model, self.optimizer = model, torch.optim.SGD(model.parameters(), lr=1e-3)
        assert self.optimizer is not None
        self.optimizer.zero_grad()
        self.model(batch).pow(2).mean().backward()
        self.optimizer.step()
        time.sleep(STEP_WAIT)


def _tune(out: Path, budget: float) -> None:
    """Tune here: jointly under torchrun, else alone."""
    import autoloader

    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    dataset = DecodeAndRead()
    sampler = DistributedSampler(dataset) if dist.is_initialized() else None
    result = autoloader.tune(
        dataset,
        Step(),
        batch_size=BATCH_SIZE,
        time_budget=budget,
        loader_kwargs={"sampler": sampler} if sampler is not None else None,
        show_progress=False,
    )
    result.save(out)
    if dist.is_initialized():
        dist.destroy_process_group()


def _measure(settings_file: Path, out: Path, rounds: int, epochs: int) -> None:
    """Measure each setting on every rank at once, interleaved; rank 0 writes."""
    from autoloader.loader._factory import build_loader, merge_loader_kwargs

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    settings: dict[str, dict[str, Any]] = json.loads(settings_file.read_text())
    dataset = DecodeAndRead()  # the dataset tuned on: the same epochs
    step = Step()
    names = list(settings)
    rates: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            params = settings[name]
            sampler = DistributedSampler(dataset)
            kwargs = merge_loader_kwargs(params, batch_size=BATCH_SIZE, fixed={"sampler": sampler})
            loader = build_loader(dataset, kwargs)
            for batch in loader:  # epoch 0, untimed: start-up and its burst
                step(batch)
            started, samples = time.perf_counter(), 0
            for epoch in range(1, epochs + 1):
                sampler.set_epoch(epoch)
                for batch in loader:  # restarts and drains included, as in training
                    step(batch)
                    samples += len(batch)
            rate = torch.tensor([samples / (time.perf_counter() - started)])
            dist.all_reduce(rate, op=dist.ReduceOp.MIN)
            rates[name].append(float(rate.item()))
            del loader
    if rank == 0:
        out.write_text(json.dumps({"ranks": size, "rates": rates}))
    dist.destroy_process_group()


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _run(command: list[str]) -> None:
    done = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")


def _launch(ranks: int, node_count: int, *args: str) -> None:
    """Run this module under torchrun: ``ranks`` per node, on one node or several."""
    if node_count == 1:
        _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
              f"--nproc_per_node={ranks}", "-m", "benchmarks.torchrun_joint", *args])  # fmt: skip
        return
    hosts = tuple(f"node-{chr(ord('a') + n)}" for n in range(node_count))
    with tempfile.TemporaryDirectory() as logs:
        job = nodes.start(
            ["-m", "benchmarks.torchrun_joint", *args],
            cwd=Path(logs), hosts=hosts, ranks_per_node=ranks, env=_env(),
        )  # fmt: skip
        if not job.wait(1200) or any(job.returncodes):
            sys.exit(f"the {node_count}-node job failed:\n{job.output()[-4000:]}")


def _lightning(ranks: int) -> dict[str, Any]:
    cpus = len(os.sched_getaffinity(0))
    return {"num_workers": max(1, cpus // ranks - 1), "prefetch_factor": 2}


def _describe(params: dict[str, Any]) -> str:
    words = [f"{params['num_workers']} workers"]
    if params["num_workers"]:
        words.append(f"prefetch {params.get('prefetch_factor')}")
        if params.get("persistent_workers"):
            words.append("persistent")
    return ", ".join(words)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="per node")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--time-budget", type=float, default=30.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    me = "benchmarks.torchrun_joint"
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        single_file = work / "single.json"
        started = time.perf_counter()
        _run([sys.executable, "-m", me, "tune", str(single_file), str(args.time_budget)])
        single = json.loads(single_file.read_text())["params"]
        print(f"single-process choice ({time.perf_counter() - started:.0f} s): "
              f"{_describe(single)}", flush=True)  # fmt: skip
        for per_node in args.ranks:
            ranks = per_node * args.nodes
            joint_file = work / f"joint{ranks}.json"
            started = time.perf_counter()
            _launch(per_node, args.nodes, "tune", str(joint_file), str(args.time_budget))
            joint_result = json.loads(joint_file.read_text())
            joint = joint_result["params"]
            print(f"{ranks} ranks on {args.nodes} node(s), joint choice "
                  f"({time.perf_counter() - started:.0f} s, tune() "
                  f"{joint_result['tuning_seconds']:.1f} s): {_describe(joint)}",
                  flush=True)  # fmt: skip
            settings = {
                "joint": joint, "single copied": single, "lightning": _lightning(per_node)
            }  # fmt: skip
            settings_file, measured = work / "settings.json", work / f"measured{ranks}.json"
            settings_file.write_text(json.dumps(settings))
            _launch(per_node, args.nodes, "measure", str(settings_file), str(measured),
                    str(args.rounds), str(args.epochs))  # fmt: skip
            rates = json.loads(measured.read_text())["rates"]
            joint_rate = statistics.median(rates["joint"])
            for name, params in settings.items():
                median = statistics.median(rates[name])
                rows.append({
                    "nodes": args.nodes, "ranks": ranks, "setting": name, "params": params,
                    "workers_total": ranks * int(params["num_workers"]),
                    "rates": rates[name], "median": median,
                    "joint_over_this": joint_rate / median if median else float("inf"),
                })  # fmt: skip
    print(
        "\n| nodes | ranks | setting | per rank | workers in total | samples/s per rank "
        "(slowest rank, median, min-max) | job samples/s | joint / this |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        low, high = min(row["rates"]), max(row["rates"])
        print(f"| {row['nodes']} | {row['ranks']} | {row['setting']} | "
              f"{_describe(row['params'])} | "
              f"{row['workers_total']} | {row['median']:.0f} ({low:.0f}-{high:.0f}) | "
              f"{row['ranks'] * row['median']:.0f} | {row['joint_over_this']:.3f} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "tune":
        _tune(Path(sys.argv[2]), float(sys.argv[3]))
    elif len(sys.argv) > 1 and sys.argv[1] == "measure":
        _measure(Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
