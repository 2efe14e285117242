"""``path=`` under torchrun: rank 0 saves the result the ranks tuned together, and a
next run of the same problem reuses it on every rank, with ``tune()`` and with
``AutoLoader`` (``tests/torchrun_path_job.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_torchrun import _assert_nothing_left, _finish, _reports, _start, _torchrun

pytestmark = pytest.mark.slow  # a torchrun job of 2 ranks


def test_ranks_save_once_and_the_next_run_reuses_the_file_on_every_rank(tmp_path: Path) -> None:
    job = _start(_torchrun(2, "-m", "tests.torchrun_path_job", str(tmp_path)), tmp_path)
    output = _finish(job)
    assert job.returncode == 0, output[-3000:]
    reports = _reports(tmp_path)
    assert sorted(reports) == [0, 1], output[-3000:]
    first, last = reports[0], reports[1]

    # tune(path=): tuned jointly, saved by rank 0 (the other rank sees the file too,
    # on this one machine), then reused by both without a step.
    assert first["tune"] == last["tune"] and first["tune_steps"] == last["tune_steps"] > 0
    saved = json.loads((tmp_path / "tuned.json").read_text())
    assert saved["environment"]["world_size"] == 2
    assert saved["params"] == first["tune"]["params"]
    assert first["tuned_saved"] and last["tuned_saved"]
    assert first["again_steps"] == last["again_steps"] == 0
    assert first["again"] == last["again"]
    assert first["again"]["params"] == first["tune"]["params"]
    assert first["again"]["trials"] == first["tune"]["trials"]  # the file's run, not a new one

    # AutoLoader(path=): the same, the second loader tuned from its first batch.
    tuned, again = first["autoloader"], first["autoloader_again"]
    assert tuned == last["autoloader"] and again == last["autoloader_again"]
    assert tuned["tuned_at_first_batch"] is False
    assert again["tuned_at_first_batch"] is True
    assert again["result"]["params"] == tuned["result"]["params"]
    assert again["result"]["trials"] == tuned["result"]["trials"]
    saved = json.loads((tmp_path / "loader.json").read_text())
    assert saved["environment"]["world_size"] == 2
    assert saved["params"] == tuned["result"]["params"]
    assert not (tmp_path / "loader.json.study").exists()  # NOTE [ An unfinished search kept ]
    assert first["steps"] == last["steps"]
    # Rank 0, which searched, removes the study as it gives its lease back; a rank that
    # removed it first made that fail.
    lease = [w for w in first["warnings"] + last["warnings"] if "lease" in w]
    assert not lease, lease

    # Its lease claimed as the first batch arrives, confirmed as the first trial ends
    # (NOTE [ The study's lease ]): lost to another run's claim, rank 0 searches in memory,
    # and the job tunes on, every rank alike.
    taken = first["taken"]
    assert taken == last["taken"] and taken["tuned_at_first_batch"] is False
    assert taken["result"]["trials"][0]["phase"] == "baseline"
    assert any("searching in memory, not in" in w for w in first["taken_warnings"])
    assert not any("lease" in w or "memory" in w for w in last["taken_warnings"])
    _assert_nothing_left(tmp_path)
