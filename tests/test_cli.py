"""The ``autoloader`` command, run as a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import autoloader


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "autoloader", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
    )


def test_demo_tunes_prints_and_saves(tmp_path: Path) -> None:
    out = tmp_path / "demo.json"
    done = _run(
        "demo", "--time-budget", "4", "--items", "512", "--out", str(out), "-q", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    for text in (
        "num_workers",
        "baseline (num_workers=0)",
        "speedup",
        "trials",
        "ceiling",
        str(out),
    ):
        assert text in done.stdout
    assert json.loads(out.read_text())["schema_version"] == 2
    assert autoloader.load(out).params["num_workers"] >= 0


def test_library_errors_are_one_line_and_exit_1(tmp_path: Path) -> None:
    done = _run("demo", "--batch-size", "0", cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.strip() == "autoloader: error: batch_size must be positive but got 0."
    assert not (tmp_path / "autoloader-demo.json").exists()


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    assert _run("frobnicate", cwd=tmp_path).returncode == 2
    assert _run("demo", "--time-budget", "soon", cwd=tmp_path).returncode == 2


def test_help_lists_the_demo(tmp_path: Path) -> None:
    done = _run("--help", cwd=tmp_path)
    assert done.returncode == 0
    assert "demo" in done.stdout
