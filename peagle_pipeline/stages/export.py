"""Export a trained draft in the speculators P-EAGLE format that vLLM loads (SPEC section 6), and load it back.

Output directory: `config.json` + `model.safetensors` (bf16 weights; `d2t` int64 and `t2d` bool only when the draft
vocabulary is smaller than the target's), written into a temporary sibling directory and renamed into place, so a
reader sees a whole export or none. The facts the export needs beyond the weights come from `RUN/draft.json`
(`DraftSpec`), written by the trainer at the start of a run. Never trains and never reads the cache.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file

from peagle_pipeline.errors import BadInput, CorruptCache, NumericalFault, OutputExists
from peagle_pipeline.runtime import atomic_write_json, fsync_dir, raise_if_no_space

if TYPE_CHECKING:
    from peagle_pipeline.core.model import PEagleDraft

__all__ = [
    "DRAFT_SPEC",
    "CONFIG_FILE",
    "WEIGHTS_FILE",
    "DraftSpec",
    "export_config",
    "write_export",
    "export_run",
    "load_export",
]

DRAFT_SPEC = "draft.json"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


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


def export_config(spec: DraftSpec) -> dict[str, Any]:
    """The speculators `config.json` of a draft (every field SPEC section 6 lists)."""
    from peagle_pipeline.core.model import DraftConfig

    draft = DraftConfig.from_target_config(
        spec.target_config,
        num_layers=spec.draft_layers,
        num_aux=len(spec.aux_layer_ids),
        draft_vocab_size=spec.draft_vocab_size,
        mask_token_id=spec.mask_token_id,
        norm_before_residual=spec.norm_before_residual,
    )
    layer = (
        draft.layer_config()
    )  # sizes, heads, head_dim, RoPE, num_aux_hidden_states (vLLM assumes 3 without)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if spec.target_config.get(key) is not None:
            layer[key] = spec.target_config[key]
    layer["torch_dtype"] = "bfloat16"
    return {
        "speculators_model_type": "peagle",  # no top-level model_type: vLLM detects speculators_config
        "speculators_config": {
            "algorithm": "peagle",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": spec.depths,
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
        "torch_dtype": "bfloat16",
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


def write_export(output: str | os.PathLike[str], spec: DraftSpec, state: dict[str, torch.Tensor]) -> Path:
    """Write config.json + model.safetensors into `output` atomically (temp dir + rename).

    An existing export in `output` is replaced; anything else there is refused.

    Raises:
        BadInput: `output` is a file.
        OutputExists: `output` exists and is not a previous P-EAGLE export.
        NumericalFault: a weight holds NaN or inf.
        OutOfSpace: the disk filled up (nothing is left behind).
    """
    from peagle_pipeline.stages.checkpoint import save_tensors

    out = Path(output)
    if out.exists() and not out.is_dir():
        raise BadInput(f"--output {out} is a file: give a directory for the export")
    weights = export_weights(spec, state)
    if out.exists() and any(out.iterdir()):
        prev = out / CONFIG_FILE
        try:
            ours = json.loads(prev.read_text()).get("speculators_model_type") == "peagle"
        except (OSError, ValueError):
            ours = False
        if not ours:
            raise OutputExists(f"{out} exists and is not a P-EAGLE export: choose another export directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_tensors(weights, tmp / WEIGHTS_FILE, metadata={"format": "pt"})
        with open(tmp / CONFIG_FILE, "w") as f:
            f.write(json.dumps(export_config(spec), indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
        fsync_dir(out.parent)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise_if_no_space(err, str(out))
    except BaseException:  # Ctrl-C included: no half-written temp folder is left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def export_run(
    run_dir: str | os.PathLike[str], output: str | os.PathLike[str], checkpoint: str = "best"
) -> Path:
    """Export checkpoint `best`, `latest` or `step-N` of a training run to `output`.

    Raises:
        BadInput: not a run directory, or no such complete checkpoint.
    """
    from peagle_pipeline.stages.checkpoint import CheckpointManager

    if Path(output).exists() and not Path(output).is_dir():
        raise BadInput(f"--output {output} is a file: give a directory for the export")
    spec = DraftSpec.load(run_dir)
    manager = CheckpointManager(run_dir, keep=1)
    ckpt = manager.load(manager.resolve(checkpoint), with_optimizer=False)
    return write_export(output, spec, ckpt.model)


def load_export(path: str | os.PathLike[str], dtype: torch.dtype = torch.bfloat16) -> PEagleDraft:
    """Rebuild a `PEagleDraft` from an export directory (weights in `dtype`), for checks and evaluation.

    Raises:
        BadInput: not a P-EAGLE export.
    """
    from peagle_pipeline.core.model import DraftConfig, PEagleDraft
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
