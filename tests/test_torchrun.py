"""Real torchrun jobs on the CPU (gloo) whose ranks tune a DDP step together.

Each test launches ``torchrun --standalone`` with ``tests/torchrun_job.py`` (or the
command line) and reads what every rank returned or raised. Faults are real: a worker
that segfaults or hangs on one rank only, a rank killed with SIGKILL, Ctrl-C sent to the
whole job. Every test ends with no process of the job left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
# A job that outlives this has hung: the tests would rather fail than wait.
_JOB_TIMEOUT = 150


def _torchrun(ranks: int, *args: str) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={ranks}", *args,
    ]  # fmt: skip


def _start(command: list[str], out: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        command,
        cwd=out,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, as a job in a terminal
    )


def _finish(job: subprocess.Popen[str]) -> str:
    try:
        output, _ = job.communicate(timeout=_JOB_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        output, _ = job.communicate()
        pytest.fail(f"the torchrun job hung:\n{output[-3000:]}")
    return output


def _job(ranks: int, out: Path, scenario: str) -> tuple[int, str, dict[int, dict[str, Any]]]:
    job = _start(_torchrun(ranks, "-m", "tests.torchrun_job", str(out), scenario), out)
    output = _finish(job)
    return job.returncode, output, _reports(out)


def _reports(out: Path) -> dict[int, dict[str, Any]]:
    return {
        report["rank"]: report
        for report in (json.loads(p.read_text()) for p in sorted(out.glob("rank*.json")))
    }


def _ranks_of(out: Path) -> list[psutil.Process]:
    """Live processes of a job run in ``out`` (ranks, their workers, the launcher)."""
    found = []
    for process in psutil.process_iter(["cmdline", "cwd"]):
        try:
            if process.info["cwd"] == str(out) and process.pid != os.getpid():
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _assert_nothing_left(out: Path) -> None:
    # DataLoader workers of a rank that was killed notice within seconds.
    _, alive = psutil.wait_procs(_ranks_of(out), timeout=15)
    assert not alive, [p.cmdline() for p in alive]


def _same_on_every_rank(reports: dict[int, dict[str, Any]], ranks: int) -> dict[str, Any]:
    assert sorted(reports) == list(range(ranks))
    results = [reports[r]["result"] for r in range(ranks)]
    assert all(result == results[0] for result in results)
    # Every rank stepped as often: a DDP step's collectives were always matched.
    assert len({reports[r]["steps"] for r in range(ranks)}) == 1
    return results[0]


def test_a_crash_or_the_nodes_memory_on_one_rank_fails_the_trial_for_every_rank(
    tmp_path: Path,
) -> None:
    code, output, reports = _job(2, tmp_path, "faults-on-rank-1")
    assert code == 0, output[-3000:]
    result = _same_on_every_rank(reports, 2)
    environment = result["environment"]
    assert (environment["world_size"], environment["local_world_size"]) == (2, 2)
    # Each rank's share of the node's CPUs.
    assert environment["usable_cpus"] == max(1, len(os.sched_getaffinity(0)) // 2)
    by_workers: dict[int, set[str]] = {}
    for trial in result["trials"]:
        if trial["state"] != "complete":
            by_workers.setdefault(trial["params"]["num_workers"], set()).add(trial["kind"])
    # Rank 1's third worker passed the node's budget, watched by rank 0.
    reasons = [(t["params"]["num_workers"], t["reason"]) for t in result["trials"]]
    assert by_workers.get(3) == {"memory"}, reasons
    crashed = [t for t in result["trials"] if t.get("kind") == "worker crashed"]
    assert crashed and all("(on rank 1)" in t["reason"] for t in crashed)
    assert result["params"]["num_workers"] <= 2
    assert any("tuned jointly by 2 ranks" in note for note in result["notes"])
    # Only rank 0 wrote the file and returned its path; rank 1 was told it wrote nothing.
    assert (tmp_path / "best.json").exists()
    assert [reports[r]["saved"] for r in (0, 1)] == [str(tmp_path / "best.json"), "None"]
    _assert_nothing_left(tmp_path)


def test_three_ranks_and_a_hang_on_one_of_them(tmp_path: Path) -> None:
    code, output, reports = _job(3, tmp_path, "hang-on-last-rank")
    assert code == 0, output[-3000:]
    result = _same_on_every_rank(reports, 3)
    hung = [t for t in result["trials"] if t.get("kind") == "timeout"]
    # Found on the rank whose worker hangs, not on the ranks whose steps waited for it.
    assert hung and all(
        "while loading a batch" in t["reason"] and "(on rank 2)" in t["reason"] for t in hung
    )
    assert result["params"]["num_workers"] <= 2
    _assert_nothing_left(tmp_path)


def _rank_pid(out: Path, rank: int) -> int:
    give_up = time.monotonic() + 60
    while time.monotonic() < give_up:
        for process in _ranks_of(out):
            try:
                environ = process.environ()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            # A rank, not one of its DataLoader workers (which inherit its environment).
            parent = process.parent()
            if environ.get("RANK") == str(rank) and parent and "RANK" not in parent.environ():
                return process.pid
        time.sleep(0.2)
    raise AssertionError(f"rank {rank} never started")


def _wait_for_trials(out: Path, rank_pid: int) -> None:
    """Until the rank runs a trial with workers: the search is under way."""
    give_up = time.monotonic() + 60
    while time.monotonic() < give_up:
        try:
            if psutil.Process(rank_pid).children():
                return
        except psutil.NoSuchProcess:
            break
        time.sleep(0.1)
    raise AssertionError("the job never ran a trial with workers")


def test_a_killed_rank_stops_the_others_with_a_clear_error(tmp_path: Path) -> None:
    job = _start(_torchrun(2, "-m", "tests.torchrun_job", str(tmp_path), "long"), tmp_path)
    victim = _rank_pid(tmp_path, 1)
    _wait_for_trials(tmp_path, victim)
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    output = _finish(job)
    assert time.monotonic() - killed < 30
    assert job.returncode != 0
    error = _reports(tmp_path)[0]["error"]
    assert error.startswith("RankError:"), error
    assert "stopped answering" in error or "stopped (SIGTERM)" in error
    _assert_nothing_left(tmp_path)
    assert "Traceback" in output  # the job says why it ended


def test_ctrl_c_stops_every_rank_and_leaves_no_process(tmp_path: Path) -> None:
    job = _start(_torchrun(2, "-m", "tests.torchrun_job", str(tmp_path), "long"), tmp_path)
    _wait_for_trials(tmp_path, _rank_pid(tmp_path, 1))
    os.killpg(job.pid, signal.SIGINT)  # as a terminal sends Ctrl-C to the whole job
    pressed = time.monotonic()
    _finish(job)
    assert time.monotonic() - pressed < 30
    assert job.returncode != 0
    reports = _reports(tmp_path)
    assert sorted(reports) == [0, 1]
    assert all(
        report["error"].startswith(("RankError", "KeyboardInterrupt"))
        for report in reports.values()
    )
    _assert_nothing_left(tmp_path)


def test_the_command_line_under_torchrun(tmp_path: Path) -> None:
    example = ROOT / "examples" / "torchrun_ddp.py"
    job = _start(
        _torchrun(
            2, "-m", "autoloader", "tune", f"{example}:make_dataset", f"{example}:step",
            "--batch-size", "32", "--time-budget", "4", "--out", "best.json", "-q",
        ),
        tmp_path,
    )  # fmt: skip
    output = _finish(job)
    assert job.returncode == 0, output[-3000:]
    assert output.count("autoloader report") == 1  # rank 0 prints, the others do not
    assert "tuned jointly by 2 ranks" in output
    saved = json.loads((tmp_path / "best.json").read_text())
    assert saved["environment"]["world_size"] == 2
    _assert_nothing_left(tmp_path)
