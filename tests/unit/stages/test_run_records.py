"""A run folder's records read back (`stages.run_records`): metrics survive a torn last line, and a run keeps
its identity when its folder moves."""

import doctest
import json
import shutil

from peagle_pipeline.stages import run_records
from peagle_pipeline.stages.run_layout import METRICS_FILE, RUN_JSON


def test_the_module_example_holds():
    assert doctest.testmod(run_records).failed == 0


def test_metrics_of_a_run_without_a_file_are_empty(tmp_path):
    assert run_records.read_metrics(tmp_path) == []


def test_a_malformed_line_in_the_middle_is_skipped_not_fatal(tmp_path):
    (tmp_path / METRICS_FILE).write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    assert [r["step"] for r in run_records.read_metrics(tmp_path)] == [1, 3]


def test_a_moved_run_keeps_its_start_time_and_gets_its_new_path(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / RUN_JSON).write_text(json.dumps({"starts": [{"time": "2026-12-02T10:00:00Z"}, {"time": "later"}]}))
    before = run_records.run_identity(run)
    moved = shutil.move(run, tmp_path / "moved")
    after = run_records.run_identity(moved)
    assert before["run_started"] == after["run_started"] == "2026-12-02T10:00:00Z"
    assert before["run"] != after["run"] and after["run"].endswith("moved")


def test_a_run_without_run_json_has_no_start_time(tmp_path):
    assert run_records.run_identity(tmp_path) == {"run": str(tmp_path.resolve()), "run_started": None}
