"""What the model card of an export states, read from the run folder, the export and the caches (`gather`).

Reads only; a fact that cannot be read (a cache moved away or on an object store, a run from before a record
existed) is None or left out, and the card says less.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peagle_pipeline.stages.draft_spec import DraftSpec

__all__ = ["DEFAULT_METHOD", "CacheFacts", "CardFacts", "gather", "hub_id", "on_policy", "target_license"]

DEFAULT_METHOD = "peagle"  # train.yaml without a `method` key: the only method of runs from before it existed
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HF_CACHE_DIR = re.compile(r"models--([^/]+?)--([^/]+)/snapshots/")


def hub_id(name_or_path: str) -> str | None:
    """The model hub id a target name stands for: `org/name` itself (not an existing local path), or the repo of a
    hub cache snapshot folder (`.../models--org--name/snapshots/REV`); None for another local folder."""
    found = _HF_CACHE_DIR.search(name_or_path)
    if found:
        return f"{found.group(1)}/{found.group(2)}"
    if _HUB_ID.match(name_or_path) and not os.path.exists(name_or_path):
        return name_or_path
    return None


@dataclass(frozen=True)
class CacheFacts:
    """One cache a run read: its role (training, extra, held-out), size and where its samples came from."""

    role: str
    samples: int
    tokens: int
    supervised: int
    sources: list[tuple[str, int]]
    on_policy: bool | None  # None: the sources are not where the cache recorded them
    template_kwargs: dict[str, Any]


@dataclass
class CardFacts:
    spec: DraftSpec
    train: dict[str, Any]
    method: str
    target_name: str
    base_model: str | None
    served_depths: int
    export_dir: str
    checkpoint: str | None = None
    step: int = 0
    total_steps: int | None = None
    world_size: int = 1
    global_batch: int | None = None
    estimate: dict[str, Any] | None = None
    caches: list[CacheFacts] = field(default_factory=list)
    license: dict[str, str] = field(default_factory=dict)

    @property
    def target_label(self) -> str:
        return self.base_model or Path(self.target_name).name

    @property
    def target_link(self) -> str | None:
        return f"https://huggingface.co/{self.base_model}" if self.base_model else None

    @property
    def serve_target(self) -> str:
        return self.base_model or self.target_name

    @property
    def draft_ref(self) -> str:
        return self.export_dir

    @property
    def repo_name(self) -> str:
        return f"{self.target_label.split('/')[-1]}-{self.method}"


def gather(export_dir: Path, run_dir: Path) -> CardFacts:
    """Every fact of the card of `export_dir`, written from the run in `run_dir`."""
    import yaml

    from peagle_pipeline.stages.export.marker import read_marker
    from peagle_pipeline.stages.run_layout import RUN_JSON, TRAIN_YAML
    from peagle_pipeline.stages.run_records import read_metrics

    spec = DraftSpec.load(run_dir)
    train = _read(lambda: (yaml.safe_load((run_dir / TRAIN_YAML).read_text()) or {}).get("train"), {})
    run = _read(lambda: json.loads((run_dir / RUN_JSON).read_text()), {})
    config = _read(lambda: json.loads((export_dir / "config.json").read_text()), {})
    marker = read_marker(export_dir)
    caches = _caches(train, run)
    base = hub_id(spec.verifier_name_or_path)
    facts = CardFacts(
        spec=spec,
        train=train,
        method=str(train.get("method") or DEFAULT_METHOD),
        target_name=spec.verifier_name_or_path,
        base_model=base,
        served_depths=int(config.get("speculators_config", {}).get("speculative_tokens") or spec.depths),
        export_dir=str(export_dir.resolve()),
        checkpoint=marker.get("checkpoint"),
        step=int(marker.get("step") or 0),
        total_steps=((run.get("starts") or [{}])[-1]).get("total_steps"),
        world_size=int(run.get("world_size") or 1),
        caches=caches,
        license=target_license(spec.verifier_name_or_path, base, _cache_target_dir(train, run)),
    )
    facts.global_batch = run.get("global_batch_tokens") or _batch(train, facts.world_size)
    evals = [r for r in read_metrics(run_dir) if r.get("kind") == "eval"]
    at_step = [r for r in evals if r.get("step") == facts.step]
    found = at_step or evals
    facts.estimate = found[-1] if found else None
    return facts


def _read(load: Any, default: Any) -> Any:
    try:
        found = load()
    except (OSError, ValueError, AttributeError):
        return default
    return found if isinstance(found, type(default)) else default


def _batch(train: dict[str, Any], world: int) -> int | None:
    tokens = train.get("tokens_per_step")
    return None if tokens is None else int(tokens) * world * int(train.get("grad_accum") or 1)


def _cache_paths(train: dict[str, Any], run: dict[str, Any]) -> list[tuple[str, str]]:
    """(role, path) of each cache the run read; the training cache at its recorded real path if it moved."""
    main = str(train.get("cache") or "")
    if run.get("cache_realpath") and not os.path.exists(main):
        main = str(run["cache_realpath"])
    found = [("training", main)] if main else []
    found += [(f"extra {i + 1}", str(p)) for i, p in enumerate(train.get("extra_cache") or [])]
    if train.get("eval_cache"):
        found.append(("held-out", str(train["eval_cache"])))
    return found


def _cache_target_dir(train: dict[str, Any], run: dict[str, Any]) -> Path | None:
    from peagle_pipeline.cache import layout

    paths = _cache_paths(train, run)
    return Path(paths[0][1]) / layout.TARGET_DIR if paths else None


def _caches(train: dict[str, Any], run: dict[str, Any]) -> list[CacheFacts]:
    from peagle_pipeline.cache.reader import open_cache
    from peagle_pipeline.errors import PeagleError

    out = []
    for role, path in _cache_paths(train, run):
        try:
            cache = open_cache(path, check=False)
        except (PeagleError, OSError, ValueError):
            continue  # moved away, on a store not reachable now: the card says less
        samples = cache.samples
        counts = samples["source"].value_counts(sort=False)
        out.append(
            CacheFacts(
                role=role,
                samples=len(samples),
                tokens=int(samples["length"].sum()),
                supervised=int(samples["num_supervised"].sum()),
                sources=[(_source_name(str(s)), int(n)) for s, n in counts.items()],
                on_policy=on_policy([str(s) for s in counts.index]),
                template_kwargs=dict(cache.meta.chat_template_kwargs or {}),
            )
        )
    return out


def _source_name(source: str) -> str:
    """A data source as the card shows it: a local file by its name (no local paths), anything else as is."""
    return Path(source).name if os.path.isabs(source) else source


def on_policy(sources: list[str]) -> bool | None:
    """True when a source is the output of `generate` (the target's own replies); None when none can be found."""
    from peagle_pipeline.data.onpolicy_files import META_FILE

    seen = [Path(s) for s in sources if os.path.exists(s)]
    if not seen:
        return None
    return any((p / META_FILE).is_file() or (p.parent / META_FILE).is_file() for p in seen)


def target_license(name_or_path: str, hub: str | None, cache_target: Path | None) -> dict[str, str]:
    """`license` (with `license_name` / `license_link` for "other") from the metadata header of the target's
    README.md: its local folder, the hub's local cache of its repo (never fetched), or the cache's target/ copy."""
    candidates = [Path(name_or_path) / "README.md"]
    if cache_target is not None:
        candidates.append(cache_target / "README.md")
    if hub:
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(hub, "README.md")
            if isinstance(cached, str):
                candidates.append(Path(cached))
        except (ImportError, ValueError):
            pass
    for path in candidates:
        meta = _readme_metadata(path)
        if isinstance(meta.get("license"), str):
            keys = ("license", "license_name", "license_link")
            return {k: str(meta[k]) for k in keys if isinstance(meta.get(k), str)}
    return {}


def _readme_metadata(path: Path) -> dict[str, Any]:
    """The YAML header (`---` ... `---`) of a model card; {} without a readable one."""
    import yaml

    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return {}
    if not text.startswith("---"):
        return {}
    end = text.find("\n---", 3)
    try:
        meta = yaml.safe_load(text[3:end]) if end != -1 else None
    except yaml.YAMLError:
        return {}
    return meta if isinstance(meta, dict) else {}
