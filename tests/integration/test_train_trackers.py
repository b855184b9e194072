"""`train --report-to`: W&B (offline mode, its run folder read back), MLflow (the run's own file store, read back
through its client), trackio (the run's own store, read back through trackio's API) and TensorBoard receive what
metrics.jsonl receives, the resolved settings and the plots; a resumed run continues the same W&B, MLflow and
trackio runs; a tracker that is not installed is one line, exit 2, and nothing is written.
"""

from __future__ import annotations

import http.server
import json
import struct
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cli_argv import small_train_flags
from cli_run import run_cli

from peagle_pipeline.cli import main
from peagle_pipeline.stages.train import metrics
from peagle_pipeline.stages.train.trackers import TRACKIO_REMOTE, scalars

pytestmark = pytest.mark.slow

FLAGS = small_train_flags(
    depths=2, tokens_per_step=256, eval_every=2, save_every=2, num_workers=0, eval_samples=4
)


def train(cache: Path, out: Path, *extra: str) -> int:
    return main(["train", "--cache", str(cache), "--output", str(out), *FLAGS, *extra])


def train_argv(cache: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--cache", str(cache), "--output", str(out), *FLAGS, *extra]


@pytest.fixture
def offline_trackers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """W&B offline and its own folders in tmp_path; MLflow and trackio with no server or store named (the run's
    own stores)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    for var in (
        "WANDB_PROJECT",
        "WANDB_RUN_ID",
        "WANDB_RESUME",
        "MLFLOW_TRACKING_URI",
        "MLFLOW_EXPERIMENT_NAME",
        "TRACKIO_DIR",
        *TRACKIO_REMOTE,
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(
        "MLFLOW_ALLOW_FILE_STORE", "true"
    )  # what the sink sets itself; restored after the test


def wandb_records(path: Path) -> list[Any]:
    """The protobuf records of a W&B run file (`run-ID.wandb`): a 7-byte header, then LevelDB-log records in
    32 KiB blocks (7-byte record header: checksum, length, type; FULL/FIRST/MIDDLE/LAST fragments)."""
    from wandb.proto import wandb_internal_pb2 as pb

    buf, block = path.read_bytes(), 32768
    assert buf[:4] == b":W&B"
    pos, part, out = 7, b"", []
    while pos + 7 <= len(buf):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", buf[pos : pos + 7])
        if left < 7 or (kind == 0 and length == 0):  # the rest of a block is padding
            pos += left
            continue
        part, pos = part + buf[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # FULL or LAST: a record is complete
            record = pb.Record()
            record.ParseFromString(part)
            out.append(record)
            part = b""
    return out


def wandb_history(run: Path) -> tuple[dict[int, dict[str, Any]], dict[str, Any], set[str]]:
    """Every offline W&B folder of a run: history rows by step, the config of the first start, the run ids."""
    rows: dict[int, dict[str, Any]] = {}
    config: dict[str, Any] = {}
    ids = set()
    for path in sorted(run.glob("wandb/offline-run-*/run-*.wandb")):
        for rec in wandb_records(path):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                ids.add(rec.run.run_id)
                config = config or {u.key: json.loads(u.value_json) for u in rec.run.config.update}
            elif kind == "history":
                items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in rec.history.item}
                rows.setdefault(int(items["_step"]), {}).update(items)
    return rows, config, ids


def test_wandb_mlflow_tensorboard_runs_read_back_and_resume_continues_them(
    tiny_cache: Path, tmp_path: Path, offline_trackers: None
) -> None:
    out = tmp_path / "run"
    report = ["--report-to", "tensorboard,wandb,mlflow"]
    assert train(tiny_cache, out, "--steps", "2", *report) == 0
    ids = json.loads((out / "trackers.json").read_text())
    assert train(tiny_cache, out, "--steps", "4", "--resume", *report) == 0
    assert json.loads((out / "trackers.json").read_text()) == ids  # the same tracker runs continued

    records = metrics.read_metrics(out)
    losses = {r["step"]: r["loss"] for r in records if r["kind"] == "train"}
    evals = {r["step"]: r for r in records if r["kind"] == "eval"}
    assert sorted(losses) == [1, 2, 3, 4] and sorted(evals) == [2, 4]

    rows, config, wandb_ids = wandb_history(out)
    assert wandb_ids == {ids["wandb"]} and len(list(out.glob("wandb/offline-run-*"))) == 2
    for step, loss in losses.items():
        assert rows[step]["train/loss"] == pytest.approx(loss, rel=1e-6), step
    assert rows[4]["eval/acceptance"] == pytest.approx(evals[4]["acceptance"], rel=1e-6)
    assert rows[4]["eval/agreement/depth1"] == pytest.approx(evals[4]["agreement"][1], rel=1e-6)
    assert config["train"]["tokens_per_step"] == 256 and config["run"]["global_batch_tokens"] == 256
    assert rows[4]["plots/loss/_type"] == "image-file"  # the plots at the end, as images the run folder holds
    assert list(out.glob(f"wandb/offline-run-*/files/{rows[4]['plots/loss/path']}"))

    from mlflow.tracking import MlflowClient

    client = MlflowClient((out / "mlruns").resolve().as_uri())
    history = client.get_metric_history(ids["mlflow"], "train/loss")
    assert {m.step: m.value for m in history} == pytest.approx(losses, rel=1e-6)
    walk = client.get_metric_history(ids["mlflow"], "eval/acceptance_walk")
    assert [m.step for m in walk] == [2, 4]
    found = client.get_run(ids["mlflow"])
    assert found.data.params["train.lr"] == "0.002" and found.info.status == "FINISHED"
    names = {a.path for a in client.list_artifacts(ids["mlflow"])}
    assert "settings.json" in names and "plots" in names
    assert {Path(a.path).name for a in client.list_artifacts(ids["mlflow"], "plots")} >= {"loss.png"}

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tb"), size_guidance={"images": 0, "scalars": 0}).Reload()
    assert {e.step: e.value for e in events.Scalars("train/loss")} == pytest.approx(losses, rel=1e-6)
    assert (
        "plots/loss" in events.Tags()["images"] and events.Tags()["tensors"]
    )  # the plots; the settings text


class _HubStandIn(http.server.BaseHTTPRequestHandler):
    """A local server in the Hugging Face Hub's place: it records the paths asked and answers 404."""

    asked: list[str] = []

    def do_GET(self) -> None:
        self.asked.append(self.path)
        self.send_error(404)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def hub_stand_in(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """A Hugging Face token in the environment and the Hub client's address on a local server: the paths asked."""
    import huggingface_hub.hf_api

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HubStandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("HF_TOKEN", "hf_" + "x" * 34)
    monkeypatch.setattr(huggingface_hub.hf_api.api, "endpoint", f"http://127.0.0.1:{server.server_port}")
    _HubStandIn.asked = []
    try:
        yield _HubStandIn.asked
    finally:
        server.shutdown()
        server.server_close()


def test_trackio_run_reads_back_and_resume_continues_it(
    tiny_cache: Path,
    tmp_path: Path,
    offline_trackers: None,
    hub_stand_in: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The run's own trackio store (RUN/trackio), read back through trackio's API: metrics.jsonl's scalars at their
    steps, the settings, the plots; a resume continues the same run. trackio's console lines stay out of the
    output, and with a Hugging Face token set the Hub is never asked (trackio asks who the user is). A store that
    TRACKIO_DIR names is shared: a second run folder of the same name gets a run of its own there."""
    out = tmp_path / "run"
    first = run_cli(train_argv(tiny_cache, out, "--steps", "2", "--report-to", "trackio"))
    assert first.code == 0, first.stderr[-3000:]
    ids = json.loads((out / "trackers.json").read_text())
    second = run_cli(train_argv(tiny_cache, out, "--steps", "4", "--resume", "--report-to", "trackio"))
    assert second.code == 0, second.stderr[-3000:]
    assert json.loads((out / "trackers.json").read_text()) == ids  # the same trackio run continued
    for result in (first, second):  # none of trackio's lines ("* Trackio project initialized: ...", ...)
        said = (result.stdout + result.stderr).splitlines()
        assert not [s for s in said if s.startswith("* ") or "Trackio" in s or "trackio show" in s], said
    assert hub_stand_in == []

    import trackio
    from trackio.sqlite_storage import SQLiteStorage

    store = out / "trackio"
    assert trackio.utils.TRACKIO_DIR == store.resolve() and (store / "peagle-pipeline.db").is_file()
    (found,) = trackio.Api().runs("peagle-pipeline")
    assert (found.name, found.id) == ("run", ids["trackio"]) and ids["trackio_name"] == "run"
    rows: dict[int, dict[str, Any]] = {}
    for row in SQLiteStorage.get_logs("peagle-pipeline", found.name, run_id=found.id):
        rows.setdefault(row["step"], {}).update(row)
    records = metrics.read_metrics(out)
    assert sorted(rows) == sorted({r["step"] for r in records}) == [1, 2, 3, 4]
    for record in records:
        for key, value in scalars(record).items():
            assert rows[record["step"]][key] == pytest.approx(value, rel=1e-6), (record["step"], key)
    assert {"eval/acceptance", "eval/agreement/depth1", "train/loss"} <= rows[4].keys()
    config = found.config
    assert config["train"]["tokens_per_step"] == 256 and config["run"]["global_batch_tokens"] == 256
    plot = rows[4]["plots/loss"]  # the plots at the end, as images trackio copied into its store
    assert plot["_type"] == "trackio.image" and (store / "media" / plot["file_path"]).is_file()

    monkeypatch.setenv("TRACKIO_DIR", str(store))
    other = tmp_path / "other" / "run"
    assert run_cli(train_argv(tiny_cache, other, "--steps", "1", "--report-to", "trackio")).code == 0
    assert json.loads((other / "trackers.json").read_text())["trackio_name"] == "run-2"
    assert not (other / "trackio").exists()
    assert sorted(r.name for r in trackio.Api().runs("peagle-pipeline")) == ["run", "run-2"]


def test_trackio_with_a_space_named_is_one_line(
    tiny_cache: Path, tmp_path: Path, offline_trackers: None, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """trackio here writes a local store only: a Space named in its variables is refused, exit 2."""
    monkeypatch.setenv("TRACKIO_SPACE_ID", "someone/drafts")
    assert train(tiny_cache, tmp_path / "run", "--steps", "1", "--report-to", "trackio") == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: --report-to trackio: TRACKIO_SPACE_ID is set")
    assert not (tmp_path / "run" / "trackio").exists()


@pytest.mark.parametrize("missing", ["wandb", "mlflow", "trackio"])
def test_a_tracker_not_installed_is_one_line_and_nothing_written(
    tiny_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys, missing: str
) -> None:
    monkeypatch.setitem(sys.modules, missing, None)  # `import` and find_spec see no such package
    out = tmp_path / "run"
    assert train(tiny_cache, out, "--steps", "1", "--report-to", f"tensorboard,{missing}") == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: --report-to {missing}: {missing} is not installed (pip install 'peagle-pipeline[{missing}]', "
        "or leave it out)"
    ]
    assert not out.exists()


def test_report_to_none_and_an_unknown_tracker(tiny_cache: Path, tmp_path: Path, capsys) -> None:
    assert train(tiny_cache, tmp_path / "bad", "--steps", "1", "--report-to", "tensorboard,comet") == 2
    err = capsys.readouterr().err
    assert "unknown tracker 'comet'" in err and "list of tensorboard, wandb, mlflow, trackio, or none" in err
    assert not (tmp_path / "bad").exists()
    out = tmp_path / "quiet"
    assert train(tiny_cache, out, "--steps", "1", "--report-to", "none") == 0
    assert metrics.read_metrics(out) and not (out / "tb").exists() and not (out / "trackers.json").exists()


def test_a_tracker_that_does_not_start_is_one_line(
    tiny_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """An MLflow server that does not answer (a closed port): one line naming the tracker and the setting, exit 2;
    the run never trained, so the same command starts it again once the tracker is fixed."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    out = tmp_path / "run"
    assert train(tiny_cache, out, "--steps", "1", "--report-to", "mlflow") == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: --report-to mlflow: it did not start (")
    assert "check MLFLOW_TRACKING_URI" in errors[0]
    assert train(tiny_cache, out, "--steps", "1", "--report-to", "none") == 0
