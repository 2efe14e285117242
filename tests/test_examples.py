"""The examples run, as a user would run them, and do what they say: each test checks
the example's promise (the training runs with the settings the tuning saved, every
sample once), not only that it printed."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow  # the examples, run as scripts

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _run(script: str, *args: str, cwd: Path) -> str:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _saved(path: Path) -> dict[str, Any]:
    saved: dict[str, Any] = json.loads(path.read_text())["params"]
    return saved


def test_image_pipeline_then_training_with_its_result(tmp_path: Path) -> None:
    out = _run("image_pipeline.py", "--time-budget", "5", "--items", "256", cwd=tmp_path)
    assert "verdict" in out and "autoloader report" in out
    params = _saved(tmp_path / "image.json")
    trained = _run(
        "train_with_best.py", "image.json", "--epochs", "2", "--items", "256", cwd=tmp_path
    )
    printed = re.search(r"settings from image.json: (\{.*\})", trained)
    assert printed is not None and ast.literal_eval(printed.group(1)) == params, trained
    # The loop's loader is the tuned one (as make_loader builds it: thread workers are
    # a ThreadLoader's own, not DataLoader's processes).
    if params["worker_kind"] == "processes":
        prefetch = params["prefetch_factor"] if params["num_workers"] else None
        assert (
            f"loader: num_workers={params['num_workers']}, prefetch_factor={prefetch}, "
            f"persistent_workers={params['persistent_workers']}, "
            f"pin_memory={params['pin_memory']}"
        ) in trained, trained
    assert trained.count("256 of 256 samples") == 2, trained  # every epoch, every sample


# Beside two CPU-bound neighbours its MLP's step (two torch threads) took 88 ms a batch,
# the baseline was bound by its step, and nothing was searched. A `calm` test has one
# other test beside it, two neighbours with CI's busy loop: this one runs alone.
@pytest.mark.alone
def test_tensor_dataset_fetches_whole_batches(tmp_path: Path) -> None:
    """Its promise: a vectorised index of the whole batch beats any worker count (about
    10x DataLoader's per-item reads here)."""
    out = _run("tensor_dataset.py", "--time-budget", "5", "--items", "8192", cwd=tmp_path)
    assert "autoloader report" in out
    assert _saved(tmp_path / "tensor.json")["batched_fetch"] is True, out


def test_lightning_fit_trains_with_the_tuned_loader(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    args = ("--time-budget", "4", "--items", "256", "--epochs", "1", "--out", "fit.json")
    out = _run("lightning_fit.py", *args, cwd=tmp_path)
    workers = _saved(tmp_path / "fit.json")["num_workers"]
    assert "autoloader report" in out
    assert f"the fit trained with num_workers={workers}\n" in out, out


def test_hf_trainer_trains_with_the_tuned_loader(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    args = ("--time-budget", "4", "--steps", "20", "--out", "hf.json")
    out = _run("hf_trainer.py", *args, cwd=tmp_path)
    params = _saved(tmp_path / "hf.json")
    kind = "thread" if params["worker_kind"] == "threads" else "process"
    assert "autoloader report" in out
    assert f"train() loaded with {params['num_workers']} {kind} workers: 20 steps" in out, out
