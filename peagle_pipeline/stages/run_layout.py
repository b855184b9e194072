"""The names inside a training run folder (`train --output RUN`), defined once: every stage that reads or writes
a run takes them from here (as `cache/layout.py` holds a cache's). No I/O, no imports of ours.

RUN/
  train.yaml        the resolved settings (what --resume compares)          TRAIN_YAML
  run.json          world size, the cache's identity, one record per start  RUN_JSON
  train.lock        held while a `train` writes the run                      LOCK_FILE
  metrics.jsonl     one JSON record per logged step and evaluation           METRICS_FILE
  tb/               TensorBoard events (--report-to tensorboard, the default) TB_DIR
  trackers.json     the W&B, MLflow and trackio run ids a resume continues   TRACKERS_FILE
  wandb/, mlruns/   W&B's files; MLflow's store when no server is named      (the trackers' own)
  trackio/          trackio's store when TRACKIO_DIR names none              (the tracker's own)
  plots/            `peagle-pipeline plot` PNGs                              PLOTS_DIR
  checkpoints/      step-N/, latest, best                                    CHECKPOINTS_DIR
  export/           the speculators P-EAGLE export vLLM loads                EXPORT_DIR
"""

from __future__ import annotations

__all__ = [
    "TRAIN_YAML",
    "RUN_JSON",
    "LOCK_FILE",
    "METRICS_FILE",
    "TB_DIR",
    "TRACKERS_FILE",
    "PLOTS_DIR",
    "CHECKPOINTS_DIR",
    "EXPORT_DIR",
]

TRAIN_YAML = "train.yaml"
RUN_JSON = "run.json"
LOCK_FILE = "train.lock"
METRICS_FILE = "metrics.jsonl"
TB_DIR = "tb"
TRACKERS_FILE = "trackers.json"
PLOTS_DIR = "plots"
CHECKPOINTS_DIR = "checkpoints"
EXPORT_DIR = "export"
