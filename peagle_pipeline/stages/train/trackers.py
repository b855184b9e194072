"""Experiment trackers of a training run (`train --report-to`): TensorBoard, Weights & Biases, MLflow, trackio.

Each tracker gets what metrics.jsonl gets: every `train` and `eval` record as scalars named `KIND/KEY` (a
per-depth list as `KIND/KEY/depthD`), plus the resolved settings when the run starts and the PNG plots when it
ends. Only rank 0 opens trackers (`metrics.RunSink` forwards to them). W&B, MLflow and trackio keep their run's
id in RUN/trackers.json, so a resumed run reports to the same tracker run: W&B resumes its run id (an offline run
writes a new folder under RUN/wandb/ that `wandb sync` uploads into the same run), MLflow reopens its run, trackio
continues its run by name (the name it resumes by is kept beside the id).

Where the records go is each tracker's own business, read from its environment variables: W&B's
(`WANDB_PROJECT`, default peagle-pipeline; `WANDB_MODE=offline`; its files under RUN/wandb/), MLflow's
(`MLFLOW_TRACKING_URI`, `MLFLOW_EXPERIMENT_NAME`, default peagle-pipeline). Without `MLFLOW_TRACKING_URI` the run
keeps its own MLflow file store in RUN/mlruns (`mlflow ui --backend-store-uri RUN/mlruns`). trackio writes its
SQLite store (and the plots it copies) to `TRACKIO_DIR` when the environment names one, else to the run's own
RUN/trackio (`TRACKIO_DIR=RUN/trackio trackio show --project peagle-pipeline`); trackio reads that variable once,
when it is first imported, so a process whose trackio already writes elsewhere is refused. trackio here stays
local: a Space, server or bucket named in its variables (`TRACKIO_SPACE_ID`, ...) is refused (`trackio sync`
uploads the store later), no dashboard is started, the Hub is not asked who the user is, and its console lines
stay out of the terminal.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import itertools
import json
import math
import os
import secrets
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from peagle_pipeline.config.train import TRACKERS
from peagle_pipeline.errors import BadInput
from peagle_pipeline.runtime import atomic_write_json
from peagle_pipeline.stages.run_layout import TB_DIR, TRACKERS_FILE

__all__ = ["TRACKERS_FILE", "INSTALL", "Tracker", "TrackerRun", "check_installed", "open_trackers", "scalars"]

PROJECT = "peagle-pipeline"  # trackio's project; W&B's and MLflow's when the environment names none
MLFLOW_DIR = "mlruns"
TRACKIO_STORE = "trackio"  # the run's own trackio store when TRACKIO_DIR names none
# trackio's variables that send a run to a Hugging Face Space, a server or a bucket instead of the local store
TRACKIO_REMOTE = ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL", "TRACKIO_BUCKET_ID", "TRACKIO_DATASET_ID")

# tracker -> (the module it needs, what installs it: the extra of this package; TensorBoard is a dependency)
INSTALL = {
    "tensorboard": ("tensorboard", "pip install tensorboard"),
    "wandb": ("wandb", "pip install 'peagle-pipeline[wandb]'"),
    "mlflow": ("mlflow", "pip install 'peagle-pipeline[mlflow]'"),
    "trackio": ("trackio", "pip install 'peagle-pipeline[trackio]'"),
}


class Tracker(Protocol):
    def log(self, step: int, values: dict[str, float]) -> None: ...

    def add_plots(self, paths: Sequence[Path]) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class TrackerRun:
    """What a tracker is opened with: the run folder, the step the run starts from (0, or the resumed step), the
    resolved settings to record, and whether an earlier start's tracker runs are continued."""

    run_dir: Path
    start_step: int
    settings: dict[str, Any]
    resumed: bool


def check_installed(names: Sequence[str]) -> None:
    """Raises BadInput naming the extra to install when a tracker asked for is not installed (before anything of
    the run is written)."""
    for name in names:
        module, install = INSTALL[name]
        if importlib.util.find_spec(module) is None:
            raise BadInput(f"--report-to {name}: {module} is not installed ({install}, or leave it out)")


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics record as `KIND/KEY` (a per-depth list as `KIND/KEY/depthD`)."""
    kind, out = record.get("kind", "train"), {}
    for key, value in record.items():
        if key in ("step", "kind"):
            continue
        items = enumerate(value) if isinstance(value, list) else [(None, value)]
        for depth, v in items:
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                out[f"{kind}/{key}" + ("" if depth is None else f"/depth{depth}")] = float(v)
    return out


def open_trackers(names: Sequence[str], run: TrackerRun) -> list[Tracker]:
    """Open each named tracker for `run` (rank 0); the ids of new tracker runs are saved to RUN/trackers.json."""
    ids = _read_ids(run.run_dir) if run.resumed else {}
    opened: list[Tracker] = []
    try:
        for name in names:
            try:
                opened.append(_OPEN[name](run, ids))
            except BadInput:  # a setting this package refuses, already said in one line
                raise
            except (
                Exception
            ) as err:  # the tracker's own start failed: no login, a server that does not answer
                why = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
                raise BadInput(f"--report-to {name}: it did not start ({why}); {_FIX[name]}") from None
    except BaseException:
        for tracker in opened:
            tracker.close()
        raise
    if ids:
        atomic_write_json(run.run_dir / TRACKERS_FILE, ids)
    return opened


def _read_ids(run_dir: Path) -> dict[str, str]:
    try:
        ids = json.loads((run_dir / TRACKERS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in ids.items() if isinstance(v, str)} if isinstance(ids, dict) else {}


class _TensorBoard:
    """Events under RUN/tb; a resume drops the events a killed run wrote after its checkpoint."""

    def __init__(self, run: TrackerRun, ids: dict[str, str]) -> None:
        import yaml
        from torch.utils.tensorboard import SummaryWriter

        self._tb = SummaryWriter(log_dir=str(run.run_dir / TB_DIR), purge_step=run.start_step + 1)
        self._last = run.start_step
        text = yaml.safe_dump(run.settings, sort_keys=False)
        self._tb.add_text("settings", "    " + text.replace("\n", "\n    "), run.start_step)

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self._tb.add_scalar(key, value, step)
        self._last = step

    def add_plots(self, paths: Sequence[Path]) -> None:
        import numpy as np
        from PIL import Image

        for path in paths:
            with Image.open(path) as image:
                pixels = np.asarray(image.convert("RGB"))
            self._tb.add_image(f"plots/{path.stem}", pixels, self._last, dataformats="HWC")

    def close(self) -> None:
        self._tb.close()


class _Wandb:
    """A W&B run under RUN/wandb (offline with WANDB_MODE=offline), resumed by its id on --resume."""

    def __init__(self, run: TrackerRun, ids: dict[str, str]) -> None:
        import wandb

        run_id = ids.get("wandb") or ids.setdefault("wandb", secrets.token_hex(4))  # W&B's 8-character form
        self._wandb = wandb
        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or PROJECT,
            name=run.run_dir.resolve().name,
            dir=str(run.run_dir),
            id=run_id,
            resume="allow",
            config=run.settings,
            settings=wandb.Settings(console="off", silent=True),
        )

    def log(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)

    def add_plots(self, paths: Sequence[Path]) -> None:
        self._run.log({f"plots/{p.stem}": self._wandb.Image(str(p)) for p in paths})

    def close(self) -> None:
        self._run.finish()


class _Mlflow:
    """An MLflow run (the client API: no process-wide active run), reopened by its id on --resume. The
    settings are its params (recorded once: MLflow params never change) and `settings.json` (each start)."""

    def __init__(self, run: TrackerRun, ids: dict[str, str]) -> None:
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # the run's own store; MLflow asks for this opt-in to use its file store
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (run.run_dir / MLFLOW_DIR).resolve().as_uri()
        self._client, self._done = MlflowClient(uri), False
        if "mlflow" in ids:
            self._id = ids["mlflow"]
            self._client.update_run(self._id, status="RUNNING")
        else:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or PROJECT
            found = self._client.get_experiment_by_name(name)
            experiment = found.experiment_id if found else self._client.create_experiment(name)
            self._id = ids["mlflow"] = self._client.create_run(
                experiment, run_name=run.run_dir.resolve().name
            ).info.run_id
            flat = _flatten(run.settings)
            keys = list(flat)
            for i in range(0, len(keys), 100):  # MLflow takes at most 100 params a batch
                self._client.log_batch(self._id, params=[_param(k, flat[k]) for k in keys[i : i + 100]])
        self._client.log_dict(self._id, run.settings, "settings.json")

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(self._id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def add_plots(self, paths: Sequence[Path]) -> None:
        for path in paths:
            self._client.log_artifact(self._id, str(path), "plots")
        self._done = True

    def close(self) -> None:  # a run stopped before its end (Ctrl-C, a fault) is marked KILLED until resumed
        self._client.set_terminated(self._id, status="FINISHED" if self._done else "KILLED")


def _flatten(settings: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in settings.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _param(key: str, value: Any) -> Any:
    from mlflow.entities import Param

    return Param(key, json.dumps(value) if isinstance(value, (list, dict)) or value is None else str(value))


class _Trackio:
    """A trackio run in a local store (TRACKIO_DIR, else RUN/trackio), named after the run folder (with a suffix
    when a shared store has that name already), continued by that name on --resume; the settings are its config,
    the plots trackio images at the last step. No CPU/GPU sampling threads: it gets what metrics.jsonl gets."""

    def __init__(self, run: TrackerRun, ids: dict[str, str]) -> None:
        remote = [v for v in TRACKIO_REMOTE if os.environ.get(v)]
        if remote:
            raise BadInput(
                f"--report-to trackio: {remote[0]} is set, and this tracker writes only to a local store "
                f"(TRACKIO_DIR, else RUN/{TRACKIO_STORE}): unset it; `trackio sync` uploads the store later"
            )
        self._trackio = trackio = _import_trackio(run.run_dir)
        with _trackio_quiet():
            name = ids.get("trackio_name") or _free_name(trackio, run.run_dir.resolve().name)
            self._run = trackio.init(
                project=PROJECT,
                name=name,
                config=run.settings,
                resume="allow" if "trackio_name" in ids else "never",
                embed=False,  # (in a notebook it would start a dashboard)
                auto_log_cpu=False,
                auto_log_gpu=False,
            )
        ids["trackio"], ids["trackio_name"] = self._run.id, name
        self._last = run.start_step

    def log(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)
        self._last = step

    def add_plots(self, paths: Sequence[Path]) -> None:
        self._run.log({f"plots/{p.stem}": self._trackio.Image(str(p)) for p in paths}, step=self._last)

    def close(self) -> None:
        with _trackio_quiet():  # trackio.finish, not the run's own: trackio's exit hook would finish it again
            self._trackio.finish()


def _import_trackio(run_dir: Path) -> Any:
    """trackio, writing to TRACKIO_DIR where the environment names it, else to RUN/trackio. trackio reads the
    variable once, as it is imported: a process whose trackio writes to another store is refused."""
    named = os.environ.get("TRACKIO_DIR") or None
    store = Path(named or run_dir / TRACKIO_STORE).expanduser().resolve()
    if "trackio" not in sys.modules:
        os.environ["TRACKIO_DIR"] = str(store)
        try:
            importlib.import_module("trackio")  # (trackio.utils reads TRACKIO_DIR now)
        finally:
            if named is None:
                del os.environ["TRACKIO_DIR"]
    import trackio

    where = Path(trackio.utils.TRACKIO_DIR).expanduser().resolve()
    if where != store:
        raise RuntimeError(f"this process's trackio writes to {where} (it reads TRACKIO_DIR once, on import)")
    return trackio


def _free_name(trackio: Any, name: str) -> str:
    """`name`, or `name-2`, `name-3`, ... when the store holds a run of that name (trackio resumes by name)."""
    try:
        taken = {r.name for r in trackio.Api().runs(PROJECT)}
    except ValueError:  # no such project in the store yet
        taken = set()
    names = itertools.chain([name], (f"{name}-{i}" for i in itertools.count(2)))
    return next(n for n in names if n not in taken)


@contextlib.contextmanager
def _trackio_quiet() -> Iterator[None]:
    """trackio's console lines (project initialized, where the metrics go, how to see the dashboard) off the
    terminal, and the Hub out of reach: with a Hugging Face token, trackio asks the Hub who the user is for its
    config; Hub offline mode makes that an error it handles (the user name is left out)."""
    from huggingface_hub import constants

    offline, constants.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE, True
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        constants.HF_HUB_OFFLINE = offline


_OPEN: dict[str, Any] = {"tensorboard": _TensorBoard, "wandb": _Wandb, "mlflow": _Mlflow, "trackio": _Trackio}
_FIX = {
    "tensorboard": "check that RUN/tb can be written",
    "wandb": "run `wandb login`, or set WANDB_MODE=offline and `wandb sync` later",
    "mlflow": "check MLFLOW_TRACKING_URI (unset: the run's own store in RUN/mlruns)",
    "trackio": "check TRACKIO_DIR (unset: the run's own store in RUN/trackio)",
}
assert tuple(_OPEN) == tuple(INSTALL) == tuple(_FIX) == TRACKERS  # one sink per name that report_to accepts
