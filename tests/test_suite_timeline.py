"""tools/suite_timeline.py: the full suite's timeline read back and summarised."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.suite_timeline import Run, busy_workers, read, summary


def test_busy_workers_count_each_tests_share_of_each_bucket() -> None:
    runs = [
        Run("gw0", 0.0, 45.0, 10.0, ("alone",), "a"),  # the whole first bucket, half the next
        Run("gw1", 30.0, 60.0, 5.0, (), "b"),  # the whole second bucket
        Run("gw2", 60.0, 75.0, 1.0, ("light",), "c"),  # half the third
    ]
    assert busy_workers(runs) == [1.0, 1.5, 0.5]


def test_a_folder_of_worker_files_reads_back_from_the_first_start(tmp_path: Path) -> None:
    (tmp_path / "gw0.tsv").write_text(
        "gw0\t1000.000\t1010.000\t4.00\talone,slow\ttests/t.py::first\n"
        "gw0\t1040.000\t1050.000\t9.00\t\ttests/t.py::third\n"
    )
    (tmp_path / "gw1.tsv").write_text("gw1\t1010.000\t1040.000\t2.50\tcalm\ttests/t.py::second\n")
    runs = read(tmp_path)
    assert [(r.test, r.start, r.end, r.marks) for r in runs] == [
        ("tests/t.py::first", 0.0, 10.0, ("alone", "slow")),
        ("tests/t.py::second", 10.0, 40.0, ("calm",)),
        ("tests/t.py::third", 40.0, 50.0, ()),
    ]
    lines = summary(runs)
    assert lines[0] == "3 tests in 50.0 s; 16 CPU s, 50 s of tests"
    assert "alone: 1 tests, 10 s, from 0 s to 10 s" in lines
    assert "calm: 1 tests, 30 s, from 10 s to 40 s" in lines
    assert "CPU s of the tests started in each minute: 16" in lines


def test_an_empty_folder_says_how_to_make_a_timeline(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="run the suite with SUITE_TIMELINE="):
        read(tmp_path)
