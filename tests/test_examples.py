"""The examples run, as a user would run them, so they never rot."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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


def test_image_pipeline_then_training_with_its_result(tmp_path: Path) -> None:
    out = _run("image_pipeline.py", "--time-budget", "5", "--items", "256", cwd=tmp_path)
    assert "verdict" in out and "autoloader report" in out
    trained = _run(
        "train_with_best.py", "image.json", "--epochs", "1", "--items", "256", cwd=tmp_path
    )
    assert "settings from image.json" in trained and "epoch 0:" in trained


def test_tensor_dataset(tmp_path: Path) -> None:
    out = _run("tensor_dataset.py", "--time-budget", "5", "--items", "8192", cwd=tmp_path)
    assert "autoloader report" in out and (tmp_path / "tensor.json").exists()


def test_lightning_fit(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    args = ("--time-budget", "4", "--items", "256", "--epochs", "1", "--out", "fit.json")
    out = _run("lightning_fit.py", *args, cwd=tmp_path)
    assert "autoloader report" in out and "the fit trained with num_workers=" in out
    assert (tmp_path / "fit.json").exists()


def test_hf_trainer(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    args = ("--time-budget", "4", "--steps", "20", "--out", "hf.json")
    out = _run("hf_trainer.py", *args, cwd=tmp_path)
    assert "autoloader report" in out and "train() loaded with" in out
    assert (tmp_path / "hf.json").exists()
