"""Tune with the code of another git revision, to compare it with this checkout side by side.

A refactor or a change to the search is judged by the settings it chooses, measured in
the same rounds as what the code before it chooses. ``tune_at(code, ...)`` runs
``autoloader.tune()`` in a process of its own whose ``autoloader`` is imported from
``code`` (a checkout of any revision: ``checkout(rev)`` makes one with
``git worktree``), on a workload of ``workloads.py`` or a pipeline of
``pipelines.py`` as this checkout defines them, and returns what it chose. Running both
revisions this way, one after the other, puts them on equal terms: each tunes in a fresh
process, with the machine to itself.

    python benchmarks/search_quality.py --before 8630f98 ...
    python benchmarks/real_pipelines.py --before 8630f98 ...
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CHECKOUT = HERE.parent
_MARK = "tuned-at-revision: "


def checkout(rev: str) -> Path:
    """A detached work tree of ``rev`` (made once, then reused), for :func:`tune_at`."""
    sha = subprocess.run(
        ["git", "-C", str(CHECKOUT), "rev-parse", "--verify", f"{rev}^{{commit}}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    where = Path(os.environ.get("TMPDIR", "/tmp")) / f"autoloader-{sha[:12]}"
    if not (where / "autoloader" / "__init__.py").is_file():
        subprocess.run(
            ["git", "-C", str(CHECKOUT), "worktree", "add", "--force", "--detach", str(where), sha],
            check=True,
            capture_output=True,
        )
    return where


def base(variant: str) -> str:
    """A benchmark's variant without the revision it runs at (``"first run @8c9f014"``)."""
    return variant.split(" @", 1)[0]


def revision_env(variant: str) -> dict[str, str] | None:
    """The environment of a run of ``variant``: for ``"... @REV"``, ``autoloader``
    imported from REV's checkout (:func:`checkout`) and the benchmarks from here;
    ``None`` (this checkout's) otherwise."""
    if " @" not in variant:
        return None
    code = checkout(variant.split(" @", 1)[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(code), str(HERE)])}


def tune_at(
    code: Path,
    *,
    time_budget: float,
    workload: str | None = None,
    pipeline: str | None = None,
    data: Path | None = None,
) -> dict[str, Any]:
    """``autoloader.tune()`` of ``workload`` (or ``pipeline``, its data under ``data``)
    with the ``autoloader`` found in ``code``: the settings it chose (``params``), its
    trials, its claimed speedup and the seconds it took, or ``error`` if it refused."""
    command = [sys.executable, "-W", "ignore", str(Path(__file__).resolve())]
    command += ["--time-budget", str(time_budget)]
    if workload is not None:
        command += ["--workload", workload]
    else:
        command += ["--pipeline", str(pipeline), "--data", str(data)]
    # Ahead of the installed (editable) autoloader on sys.path: this revision's.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(code), str(HERE)])}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith(_MARK)]
    if done.returncode or not lines:
        why = done.stderr[-3000:]
        raise RuntimeError(f"tune() at {code} failed (exit {done.returncode}):\n{why}")
    found: dict[str, Any] = json.loads(lines[-1][len(_MARK) :])
    return found


def tune_now_and_before(
    before: str, *, before_first: bool, time_budget: float, **problem: Any
) -> dict[str, dict[str, Any]]:
    """:func:`tune_at` with this checkout (``"now"``) and with the code at git revision
    ``before`` (``"before"``), one after the other, the revision first if
    ``before_first`` (callers alternate it between problems); ``problem`` names the
    workload or the pipeline as :func:`tune_at` takes it. Each line printed as it ends."""
    code = {"now": CHECKOUT, "before": checkout(before)}
    order = ["before", "now"] if before_first else ["now", "before"]
    found = {}
    for which in order:
        one = tune_at(code[which], time_budget=time_budget, **problem)
        chosen = one.get("error") or f"{setting(one['params'])} ({one['trials']} trials)"
        print(f"tuned {which} ({code[which].name}) in {one['seconds']:.1f} s: {chosen}", flush=True)
        found[which] = one
    return {which: found[which] for which in ("now", "before")}


def run_result_child(
    command: list[str], *, marker: str, timeout: float, env: dict[str, str] | None = None
) -> tuple[dict[str, Any] | None, str]:
    """Run ``command`` (a benchmark's child) in a session of its own, so that a run past
    ``timeout`` goes with its workers, which hold its pipes open (subprocess.run's
    timeout kills the child only, then waits on them). Returns the JSON of its last
    stdout line that starts with ``marker``, or ``None`` where there is none or it
    failed; and, then, why: its exit status and the last lines of its stderr."""
    child = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, env=env,
    )  # fmt: skip
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        out, err = child.communicate()
    results = [line for line in out.splitlines() if line.startswith(marker)]
    if child.returncode != 0 or not results:
        tail = " | ".join(err.strip().splitlines()[-3:])
        return None, f"exit status {child.returncode}: {tail}"
    return json.loads(results[-1][len(marker) :]), ""


def setting(params: dict[str, Any]) -> str:
    """``params`` in a few words: "6 threads, prefetch 2, persistent, batched"."""
    workers = params.get("num_workers") or 0
    if not workers:
        words = ["0 workers"]
    else:
        kind = "threads" if params.get("worker_kind") == "threads" else "processes"
        words = [f"{workers} {kind}", f"prefetch {params.get('prefetch_factor')}"]
        if params.get("persistent_workers"):
            words.append("persistent")
        if params.get("worker_threads"):
            words.append(f"{params['worker_threads']} native thread(s)")
        if params.get("in_order") is False:
            words.append("out of order")
    if params.get("batched_fetch"):
        words.append("batched")
    if params.get("pin_memory"):
        words.append("pinned")
    return ", ".join(words)


def _child(args: argparse.Namespace) -> None:
    # An editable install's finder would serve the checkout's modules that the revision
    # lacks: only the revision's own code may be imported.
    sys.meta_path[:] = [
        finder
        for finder in sys.meta_path
        if not getattr(finder, "__module__", "").startswith("__editable__")
    ]
    import autoloader

    if args.workload:
        from workloads import WORKLOADS

        try:
            from autoloader.measure._process_memory import tree_memory
        except ImportError:  # before the package's layout (commit dc97fa4)
            from autoloader._memory import tree_memory  # type: ignore[no-redef]

        workload = WORKLOADS[args.workload]
        dataset = workload.make_dataset(workload.length)
        options: dict[str, Any] = {
            "batch_size": workload.batch_size,
            "search_space": workload.search_space,
            "memory_budget": (
                None if workload.memory_budget is None else tree_memory() + workload.memory_budget
            ),
        }
        step = workload.step()
    else:
        from pipelines import build

        built = build(args.pipeline, args.data)
        dataset, step = built.dataset, built.step
        options = {"batch_size": built.batch_size, "loader_kwargs": built.loader_kwargs}
    started = time.perf_counter()
    try:
        result = autoloader.tune(
            dataset, step, time_budget=args.time_budget, show_progress=False, **options
        )
    except autoloader.AutoloaderError as error:
        found: dict[str, Any] = {"error": f"{type(error).__name__}: {error}"}
    else:
        found = {
            "params": dict(result.params),
            "trials": len(result.trials),
            "speedup": result.speedup,
            "version": autoloader.__version__,
            "code": str(Path(autoloader.__file__).parent.parent),
        }
    found["seconds"] = time.perf_counter() - started
    print(_MARK + json.dumps(found, default=str), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="One tune() with the autoloader on PYTHONPATH.")
    parser.add_argument("--time-budget", type=float, required=True)
    parser.add_argument("--workload")
    parser.add_argument("--pipeline")
    parser.add_argument("--data", type=Path)
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    _child(parser.parse_args())
