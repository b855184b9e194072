"""Export a trained draft in the speculators P-EAGLE format that vLLM loads (SPEC section 6), and load it back.

Output directory: `config.json` + `model.safetensors` (bf16 weights; `d2t` int64 and `t2d` bool only when the draft
vocabulary is smaller than the target's) + `.peagle-export.json` (the run and checkpoint it came from), written into
a temporary sibling directory and swapped into place, so a reader sees a whole export or none. A folder is replaced
only when it holds exactly those files from the same run (another run's export: only with `force`); files we did
not write are never deleted. The facts the export needs beyond the weights come from `RUN/draft.json`
(`DraftSpec`), written by the trainer at the start of a run. Never trains and never reads the cache.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file

from peagle_pipeline.core.settings import SERVING_DEPTHS
from peagle_pipeline.errors import BadInput, CorruptCache, NumericalFault, OutputExists
from peagle_pipeline.runtime import (
    atomic_write_json,
    exchange_paths,
    fsync_dir,
    fsync_file,
    make_readable,
    raise_if_no_space,
)

if TYPE_CHECKING:
    from peagle_pipeline.core.model import PEagleDraft

log = logging.getLogger(__name__)

__all__ = [
    "DRAFT_SPEC",
    "CONFIG_FILE",
    "WEIGHTS_FILE",
    "MARKER_FILE",
    "export_run_dir",
    "read_marker",
    "EXPORT_FILES",
    "DraftSpec",
    "serving_depths",
    "trained_depths",
    "export_config",
    "run_identity",
    "TARGET_IDENTITY",
    "target_identity",
    "check_served_target",
    "same_run",
    "check_export_target",
    "write_export",
    "export_run",
    "load_export",
]

DRAFT_SPEC = "draft.json"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
MARKER_FILE = ".peagle-export.json"  # the run and checkpoint an export came from (ours; vLLM ignores it)
EXPORT_FILES = frozenset({CONFIG_FILE, WEIGHTS_FILE, MARKER_FILE})


@dataclass(frozen=True, kw_only=True)
class DraftSpec:
    """Everything (besides weights) that defines a trained draft; saved as RUN/draft.json."""

    target_config: dict[str, Any]
    verifier_name_or_path: str
    verifier_architectures: list[str]
    aux_layer_ids: list[int]
    draft_layers: int
    draft_vocab_size: int
    mask_token_id: int
    norm_before_residual: bool
    depths: int
    # Qwen3 draft layers (QK-norm, `core.draft_config.has_qk_norm` of the target); False in runs started before them.
    qk_norm: bool = False
    # The target the draft was trained on, from the cache (`target_identity`); None in runs started before it
    # was recorded. The export's marker carries it, and vllm-check / evaluate compare it with the target given.
    target_identity: dict[str, str] | None = None

    @property
    def vocab_size(self) -> int:
        return int(self.target_config["vocab_size"])

    @property
    def hidden_size(self) -> int:
        return int(self.target_config["hidden_size"])

    def save(self, run_dir: str | os.PathLike[str]) -> None:
        atomic_write_json(Path(run_dir) / DRAFT_SPEC, dataclasses.asdict(self))

    @classmethod
    def load(cls, run_dir: str | os.PathLike[str]) -> DraftSpec:
        """Raises BadInput (no draft.json: not a run) or CorruptCache (a draft.json that cannot be read)."""
        path = Path(run_dir) / DRAFT_SPEC
        if not path.is_file():
            raise BadInput(f"{run_dir} is not a training run (no {DRAFT_SPEC})")
        try:
            spec = cls(**json.loads(path.read_text()))
            spec.vocab_size, spec.hidden_size  # noqa: B018 (the target facts must be there too)
        except (ValueError, TypeError, KeyError) as err:
            raise CorruptCache(
                f"{path} is damaged ({type(err).__name__}); `train --resume` on this run writes it again"
            ) from None
        return spec


def serving_depths(trained: int, requested: int | None = None) -> int:
    """The K an export records as `speculative_tokens` (what vLLM drafts unless its speculative_config says
    otherwise): `requested`, else `SERVING_DEPTHS`, never more than the `trained` depths.

    Raises:
        BadInput: `requested` is not positive or exceeds the depths the draft was trained for.
    """
    if requested is None:
        return min(SERVING_DEPTHS, trained)
    if requested < 1:
        raise BadInput(f"--speculative-tokens must be positive, got {requested}")
    if requested > trained:
        raise BadInput(
            f"--speculative-tokens {requested} exceeds the {trained} depths the draft was trained for: "
            f"give at most {trained}, or train with --depths {requested} or more"
        )
    return requested


def trained_depths(export_dir: str | os.PathLike[str], config: dict[str, Any]) -> int:
    """K the draft of an export was trained with: its marker's `trained_depths`, else (an export of an older
    version or of another tool) the `speculative_tokens` of its `config`."""
    trained = read_marker(export_dir).get("trained_depths")
    if isinstance(trained, int) and trained > 0:
        return trained
    return int(config["speculators_config"]["proposal_methods"][0]["speculative_tokens"])


def export_config(spec: DraftSpec, speculative_tokens: int | None = None) -> dict[str, Any]:
    """The speculators `config.json` of a draft (every field SPEC section 6 lists); `speculative_tokens` is the
    served K (`serving_depths`), `spec.depths` the trained one."""
    from peagle_pipeline.core.draft_config import DraftConfig

    draft = DraftConfig.from_target_config(
        spec.target_config,
        num_layers=spec.draft_layers,
        num_aux=len(spec.aux_layer_ids),
        draft_vocab_size=spec.draft_vocab_size,
        mask_token_id=spec.mask_token_id,
        norm_before_residual=spec.norm_before_residual,
        qk_norm=spec.qk_norm,
    )
    layer = (
        draft.layer_config()
    )  # sizes, heads, head_dim, RoPE, num_aux_hidden_states (vLLM assumes 3 without)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if spec.target_config.get(key) is not None:
            layer[key] = spec.target_config[key]
    layer["dtype"] = "bfloat16"  # (transformers >= 4.56's name: "torch_dtype" prints a deprecation warning)
    return {
        "speculators_model_type": "peagle",  # no top-level model_type: vLLM detects speculators_config
        "speculators_config": {
            "algorithm": "peagle",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": serving_depths(spec.depths, speculative_tokens),
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "verifier": {
                "name_or_path": spec.verifier_name_or_path,
                "architectures": list(spec.verifier_architectures),
            },
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": spec.draft_vocab_size,
        "mask_token_id": spec.mask_token_id,
        "eagle_aux_hidden_state_layer_ids": list(spec.aux_layer_ids),
        "norm_before_residual": spec.norm_before_residual,
        "norm_before_fc": False,
        "target_hidden_size": spec.hidden_size,
        "dtype": "bfloat16",
    }


def export_weights(spec: DraftSpec, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The draft state dict in export form: floats to bf16; d2t int64 / t2d bool only when Vd < V."""
    out: dict[str, torch.Tensor] = {}
    bad = [k for k, v in state.items() if v.is_floating_point() and not bool(v.isfinite().all())]
    if bad:
        raise NumericalFault(
            f"the draft's {', '.join(sorted(bad)[:3])} hold non-finite values: not exported (the run diverged; "
            "export an earlier checkpoint with --checkpoint step-N, or retrain with a lower lr)"
        )
    for key, value in state.items():
        if key in ("d2t", "t2d"):
            continue
        value = value.detach().to("cpu")
        out[key] = (value.to(torch.bfloat16) if value.is_floating_point() else value).contiguous()
    if spec.draft_vocab_size < spec.vocab_size:
        for key, dtype in (("d2t", torch.int64), ("t2d", torch.bool)):
            if key not in state:
                raise BadInput(
                    f"draft with vocabulary {spec.draft_vocab_size} < {spec.vocab_size} lacks {key}"
                )
            out[key] = state[key].detach().to("cpu", dtype).contiguous()
    return out


def run_identity(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Who an export comes from: the run's path and the time of its first start (from run.json).

    The start time survives moving or copying the run folder; the path names it for people.
    """
    from peagle_pipeline.stages.run_layout import RUN_JSON

    try:
        starts = json.loads((Path(run_dir) / RUN_JSON).read_text()).get("starts") or [{}]
        started = starts[0].get("time")
    except (OSError, ValueError, AttributeError):
        started = None
    return {"run": str(Path(run_dir).resolve()), "run_started": started}


def read_marker(export_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """What an export's marker records (`run_identity`, `checkpoint`, `step`, `time`); {} without a readable one."""
    try:
        facts = json.loads((Path(export_dir) / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return facts if isinstance(facts, dict) else {}


def export_run_dir(export_dir: str | os.PathLike[str]) -> str | None:
    """The training run an export came from (its marker's "run"), or None (not ours, or no marker)."""
    run = read_marker(export_dir).get("run")
    return run if isinstance(run, str) else None


# What identifies the target a draft was trained on (the cache's fields of the same names, SPEC section 3); the
# first two must match for a draft to serve a target, the chat template only shapes the data it was trained on.
TARGET_IDENTITY = ("target_config_sha256", "tokenizer_sha256", "chat_template_sha256")


def target_identity(model_path: str | os.PathLike[str]) -> dict[str, str]:
    """The identity of a target model directory: hashes of its config.json, tokenizer files and chat template,
    computed as the cache records them (`backends.pieces`)."""
    from peagle_pipeline import model_dir

    return {
        "target_config_sha256": model_dir.config_sha256(model_path),
        "tokenizer_sha256": model_dir.tokenizer_sha256(model_path),
        "chat_template_sha256": model_dir.chat_template_sha256(model_path),
    }


def check_served_target(
    export_dir: str | os.PathLike[str], target: str, allow_other: bool = False
) -> str | None:
    """Compare the target an export was trained on (its marker's "target") with the `target` it is about to run on.

    Returns:
        A one-line warning to print, or None: an export that records no identity (written before it was
        recorded), another chat template, or another model let through by `allow_other`.

    Raises:
        BadInput: the target's config.json or tokenizer differ from the trained-on ones (and not `allow_other`).
    """
    recorded = read_marker(export_dir).get("target")
    if not isinstance(recorded, dict):
        return (
            f"note: {export_dir} records no target identity (exported before it was recorded): not compared"
        )
    given = target_identity(target)
    differ = [k for k in TARGET_IDENTITY if recorded.get(k) is not None and recorded.get(k) != given[k]]
    model = [k.removesuffix("_sha256").replace("target_", "") for k in differ if k != "chat_template_sha256"]
    if model and not allow_other:
        raise BadInput(
            f"draft {export_dir} was trained on another target than {target} (its {' and '.join(model)} differ): "
            "give the target it was trained on, or --allow-other-target to run it anyway"
        )
    if model:
        return f"warning: draft {export_dir} was trained on another target ({' and '.join(model)} differ)"
    if differ:
        return (
            f"warning: {target}'s chat template differs from the one draft {export_dir} was trained with: "
            "acceptance may be lower"
        )
    return None


def same_run(marker: dict[str, Any], source: dict[str, Any] | None) -> bool:
    """Whether an export's marker names the run `source` (`run_identity`): by first start time, else by path."""
    if source is None:
        return False
    if marker.get("run_started") is not None or source.get("run_started") is not None:
        return marker.get("run_started") == source.get("run_started")
    return marker.get("run") == source.get("run")


def check_export_target(
    output: str | os.PathLike[str], source: dict[str, Any] | None, force: bool = False, own: bool = False
) -> None:
    """Refuse an `output` that an export may not replace (issue 15): nothing there is ever deleted unless it is
    exactly an export (config.json, model.safetensors, the marker) of the same run, or of another run with `force`.

    Args:
        source: `run_identity` of the run being exported (None: unknown).
        own: `output` is the run's own `RUN/export`: an export there without a marker (written before markers
            existed) belongs to the run.

    Raises:
        OutputExists: `output` is a file, holds anything else, is not a P-EAGLE export, or is another run's
            export (without `force`).
    """
    out = Path(output)
    if not out.exists():
        return
    if not out.is_dir():
        raise OutputExists(f"{out} exists and is not a directory: choose another export directory")
    names = {p.name for p in out.iterdir()}
    foreign = sorted(names - EXPORT_FILES)
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        hint = "move them out or pass --no-export" if own else "move them out or choose another --output"
        raise OutputExists(f"{out} holds files that are not part of a P-EAGLE export ({shown}): {hint}")
    if not names:
        return
    try:
        ours = json.loads((out / CONFIG_FILE).read_text()).get("speculators_model_type") == "peagle"
    except (OSError, ValueError, AttributeError):
        ours = False
    if not ours:
        raise OutputExists(
            f"{out} is not a P-EAGLE export (its {CONFIG_FILE}): choose another export directory"
        )
    try:
        marker = json.loads((out / MARKER_FILE).read_text())
    except FileNotFoundError:
        marker = None
    except (OSError, ValueError):
        marker = {}
    if force or (marker is None and own) or (marker and same_run(marker, source)):
        return
    if marker and marker.get("run"):
        what = f"the export of another run ({marker['run']}, {marker.get('checkpoint')})"
    else:
        what = "a P-EAGLE export of unknown origin"
    raise OutputExists(f"{out} holds {what}: pass --force to replace it, or choose another --output")


def write_export(
    output: str | os.PathLike[str],
    spec: DraftSpec,
    state: dict[str, torch.Tensor],
    source: dict[str, Any] | None = None,
    force: bool = False,
    own: bool = False,
    speculative_tokens: int | None = None,
) -> Path:
    """Write config.json + model.safetensors + the marker into `output`: built in a temporary sibling folder,
    then swapped in atomically (renameat2 RENAME_EXCHANGE; two renames where the OS lacks it).

    Args:
        source: what the marker records (`run_identity` plus the checkpoint); None for drafts not from a run.
        force, own: see `check_export_target`.
        speculative_tokens: the served K (`serving_depths`); the marker records the trained one.

    Raises:
        BadInput: `speculative_tokens` above the trained depths.
        OutputExists: see `check_export_target`.
        OutOfSpace: the disk filled up (the previous export, if any, is untouched).
    """
    from peagle_pipeline.stages.train.checkpoint import save_tensors

    out = Path(output)
    config = export_config(spec, speculative_tokens)  # BadInput before anything is written
    check_export_target(out, source, force=force, own=own)
    weights = export_weights(spec, state)  # NumericalFault before anything is written
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    swapped = False  # once True, `tmp` holds the previous export, not our fresh folder
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_tensors(weights, tmp / WEIGHTS_FILE, metadata={"format": "pt"})
        make_readable(tmp / WEIGHTS_FILE)  # safetensors writes 0600; a vLLM of another user must read it
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        marker = {
            **(source or {}),
            "target": spec.target_identity,
            "trained_depths": spec.depths,
            "time": time.time(),
        }
        (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
        for name in EXPORT_FILES:
            fsync_file(tmp / name)
        fsync_dir(tmp)
        if out.exists():
            os.chmod(tmp, stat.S_IMODE(out.stat().st_mode))  # keep the folder's permissions
            if not exchange_paths(tmp, out):
                old = out.with_name(f".{out.name}.old-{os.getpid()}")
                os.replace(out, old)
                os.replace(tmp, out)
                os.replace(old, tmp)
            swapped = True
            _remove_export(tmp)  # the previous export, now under the temporary name
        else:
            os.replace(tmp, out)
        fsync_dir(out.parent)
    except OSError as err:
        if swapped:
            _remove_export(tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
        raise_if_no_space(err, str(out))
    except BaseException:  # Ctrl-C included: no half-written temp folder is left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _remove_export(path: Path) -> None:
    """Delete the files an export consists of, then the folder if that left it empty (never anything else)."""
    for name in EXPORT_FILES:
        (path / name).unlink(missing_ok=True)
    try:
        path.rmdir()
    except OSError:
        log.warning("left %s in place: it holds files that are not part of an export", path)


def export_run(
    run_dir: str | os.PathLike[str],
    output: str | os.PathLike[str],
    checkpoint: str = "best",
    force: bool = False,
    speculative_tokens: int | None = None,
) -> Path:
    """Export checkpoint `best`, `latest` or `step-N` of a training run to `output`, serving
    `serving_depths(trained, speculative_tokens)` tokens (config.json's `speculative_tokens`).

    `output` may be new, empty, or hold an export of the same run (replaced); another run's export is replaced
    only with `force`; a folder holding anything else is refused (see `check_export_target`).

    Raises:
        BadInput: not a run directory, no such complete checkpoint, or `speculative_tokens` above the trained K.
        OutputExists: see `check_export_target`.
    """
    from peagle_pipeline.stages.run_layout import EXPORT_DIR
    from peagle_pipeline.stages.train.checkpoint import CheckpointManager

    if Path(output).exists() and not Path(output).is_dir():
        raise BadInput(f"--output {output} is a file: give a directory for the export")
    spec = DraftSpec.load(run_dir)
    serving_depths(spec.depths, speculative_tokens)  # refused before the (slow) checkpoint load
    source = run_identity(run_dir)
    own = Path(output).resolve() == Path(run_dir).resolve() / EXPORT_DIR
    check_export_target(output, source, force=force, own=own)  # before the (slow) checkpoint load
    manager = CheckpointManager(run_dir, keep=1)
    ckpt = manager.load(manager.resolve(checkpoint), with_optimizer=False)
    source.update(checkpoint=ckpt.path.name, step=ckpt.step)
    return write_export(
        output, spec, ckpt.model, source=source, force=force, own=own, speculative_tokens=speculative_tokens
    )


def load_export(path: str | os.PathLike[str], dtype: torch.dtype = torch.bfloat16) -> PEagleDraft:
    """Rebuild a `PEagleDraft` from an export directory (weights in `dtype`), for checks and evaluation.

    Raises:
        BadInput: not a P-EAGLE export.
    """
    from peagle_pipeline.core.draft_config import DraftConfig
    from peagle_pipeline.core.model import PEagleDraft
    from peagle_pipeline.core.vocab import DraftVocab

    path = Path(path)
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
        weights = load_file(str(path / WEIGHTS_FILE))
    except (OSError, ValueError) as err:
        raise BadInput(f"{path} is not a P-EAGLE export ({type(err).__name__})") from None
    if config.get("speculators_model_type") != "peagle":
        raise BadInput(f"{path} is not a P-EAGLE export (speculators_model_type is not 'peagle')")
    layer = config["transformer_layer_config"]
    cfg = DraftConfig.from_target_config(
        layer,
        num_layers=int(layer["num_hidden_layers"]),
        num_aux=int(layer["num_aux_hidden_states"]),
        draft_vocab_size=int(config["draft_vocab_size"]),
        mask_token_id=int(config["mask_token_id"]),
        norm_before_residual=bool(config["norm_before_residual"]),
        qk_norm=layer.get("model_type") == "qwen3",
    )
    dvocab = None
    if "d2t" in weights and "t2d" in weights:  # Vd < V: rebuild the mapping from the exported offsets
        d2t, t2d = weights["d2t"].long(), weights["t2d"].bool()
        ids = torch.arange(d2t.numel()) + d2t
        to_draft = torch.full((t2d.numel(),), -1, dtype=torch.long)
        to_draft[ids] = torch.arange(d2t.numel())
        dvocab = DraftVocab(ids=ids, d2t=d2t, t2d=t2d, target_to_draft=to_draft)
    model = PEagleDraft(cfg, None, dvocab)
    current = model.state_dict()
    full = {}
    for key, ref in current.items():
        if key in weights:
            full[key] = weights[key].to(ref.dtype if not ref.is_floating_point() else dtype)
        elif key in ("d2t", "t2d"):  # Vd == V: identity mapping, not stored
            full[key] = ref
        else:
            raise BadInput(f"{path}/{WEIGHTS_FILE} lacks {key}")
    extra = set(weights) - set(current)
    if extra:
        raise BadInput(f"{path}/{WEIGHTS_FILE} has unexpected tensors {sorted(extra)[:5]}")
    model.to(dtype)
    model.load_state_dict(full, strict=True)
    return model.eval()
