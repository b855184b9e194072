"""TrainConfig: the settings of `peagle-pipeline train` (pipeline-file section `train:`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from peagle_pipeline.config.checks import (
    check_device,
    check_finite,
    check_positive,
    refuse_duplicate_paths,
    require,
)
from peagle_pipeline.config.fields import COD_DEFAULTS, setting
from peagle_pipeline.core.settings import SERVING_DEPTHS, CODConfig
from peagle_pipeline.errors import BadConfig

__all__ = ["TrainConfig", "TRACKERS"]

TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")
"""The experiment trackers `report_to` may name (stages/train/trackers.py has one sink per name)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """Settings of `peagle-pipeline train` (pipeline-file section `train:`)."""

    cache: str = setting("", "Cache directory written by `peagle-pipeline extract`.", required=True)
    extra_cache: list[str] = setting(
        [],
        "Further caches of the same target (same top-k and stored dtype) whose every sample trains beside cache's "
        "training split; the held-out split, the target's files and the run's identity stay cache's. Repeatable.",
    )
    output: str = setting("", "Run directory (checkpoints, metrics, plots, export).", required=True)
    method: Literal["peagle", "eagle3"] = setting(
        "peagle",
        "Drafting method: peagle (P-EAGLE: all K tokens drafted in one pass, COD-sampled chains) or eagle3 (EAGLE-3: "
        "K sequential steps, each reading the previous step's token and output state; trained by training-time "
        "test over every chain to full depth, exported in the speculators eagle3 format).",
    )
    draft_layers: int = setting(1, "Decoder layers of the draft (the first is the fused EAGLE-3 layer).")
    draft_arch: Literal["auto", "llama", "qwen3"] = setting(
        "auto",
        "Style of the draft's decoder layers: llama (plain attention), qwen3 (RMS norms on queries and keys, "
        "QK-norm), or auto (the target's family: qwen3 for targets with QK-norm, llama for the rest). vLLM serves "
        "either style beside any target.",
    )
    depths: int = setting(
        COD_DEFAULTS["depths"],
        f"K trained: tokens drafted in parallel (COD depths 0..K-1). The export serves at most this many (default "
        f"{SERVING_DEPTHS}: train deeper than you serve, `export --speculative-tokens`).",
    )
    draft_vocab_size: int = setting(
        32000, "Draft vocabulary size (most frequent supervised tokens); capped at the target vocabulary."
    )
    tokens_per_step: int = setting(
        8192, "Packing budget: shifted tokens per packed row (per rank and micro-step)."
    )
    grad_accum: int = setting(
        1,
        "Gradient accumulation: packed rows per rank per optimizer step. Global batch = tokens_per_step x ranks x "
        "grad_accum tokens: one process with grad_accum N takes the steps of N ranks.",
    )
    epochs: int = setting(1, "Passes over the training split (ignored when steps is set).")
    steps: int | None = setting(None, "Optimizer steps to run (overrides epochs).")
    lr: float = setting(6e-4, "Peak learning rate (AdamW).")
    warmup: int = setting(50, "Linear warm-up steps.")
    schedule: Literal["cosine", "linear", "constant"] = setting(
        "cosine", "Learning-rate decay after warm-up."
    )
    weight_decay: float = setting(0.0, "AdamW weight decay.")
    grad_clip: float = setting(1.0, "Gradient-norm clip (0 disables).")
    down_sample_ratio: float = setting(
        COD_DEFAULTS["ratio"], "COD ratio r: depth d keeps about r**d of the anchors (peagle only)."
    )
    down_sample_ratio_min: float = setting(
        COD_DEFAULTS["ratio_min"], "COD floor r_min of the kept fraction per depth (peagle only)."
    )
    max_anchors: int = setting(
        COD_DEFAULTS["max_anchors"], "At most this many COD seeds per sample (depth >= 1 only; peagle only)."
    )
    sequence_partitions: int = setting(
        1,
        "Split each packed row into this many segments (forward+backward each) to cut memory (peagle only).",
    )
    step_loss_decay: float = setting(
        1.0,
        "eagle3: step d's loss is weighted by this to the power d (speculators' ttt_step_loss_decay); 1 weighs "
        "every step alike.",
    )
    grad_checkpointing: bool = setting(
        False, "Recompute each draft layer in backward (activation checkpointing)."
    )
    target: Literal["topk", "exact"] = setting(
        "topk", "Training target: renormalised stored top-k, or exact from the stored last hidden state."
    )
    loss_positions: Literal["assistant", "all"] = setting(
        "assistant",
        "Positions the training loss covers: assistant (the cache's loss mask: the replies) or all (every position, "
        "prompt tokens too; the target's next-token distribution is a valid target everywhere, so each cached token "
        "teaches). The held-out figures always use the loss mask.",
    )
    eval_samples: int = setting(
        64,
        "Held-out samples (fixed by seed) for agreement and acceptance estimates; training samples with the prompt "
        "of a held-out sample (in any cache) do not train.",
    )
    eval_cache: str = setting(
        "",
        "Cache whose held-out samples give the held-out loss, agreement and estimated AL (default: the training "
        "cache's own held-out split). Same target required. Give one on-policy cache to compare drafts trained on "
        "different data on one held-out set (off-policy validation overstates quality); every sample of the training "
        "cache then trains, except those with a held-out sample's prompt.",
    )
    eval_every: int = setting(100, "Evaluate every N steps (and always at the end).")
    seed: int = setting(0, "Seed of the shuffle, the held-out split, COD sampling and the draft init.")
    save_every: int = setting(200, "Write a checkpoint every N steps (and always at the end).")
    keep_checkpoints: int = setting(2, "Step checkpoints kept on disk (the best one is kept apart).")
    precision: Literal["auto", "bf16", "fp32"] = setting(
        "auto",
        "Compute precision: bf16 autocast or full fp32 (master weights stay fp32); auto = bf16 on CUDA and on CPUs whose bf16 units run it faster (AMX, or AVX512-BF16 on AMD), fp32 on other CPUs.",
    )
    device: str = setting("auto", "auto, cpu, cuda, cuda:N (under torchrun, cuda:LOCAL_RANK).")
    fsdp: bool = setting(
        False,
        "Under torchrun: shard the draft's trainable parameters, gradients and optimizer state over the ranks "
        "(torch FSDP2) instead of keeping a replica on each (DDP); same updates, same checkpoints.",
    )
    resume: bool = setting(False, "Continue the run in output from its latest complete checkpoint.")
    num_workers: int = setting(1, "DataLoader worker processes reading the cache.")
    loss_chunk: int = setting(
        2048, "Elements per chunk of the KL computation (bounds [elements, Vd] memory)."
    )
    norm_before_residual: bool = setting(
        False, "Fused layer 0: residual is the normed hidden instead of fc output."
    )
    init_from_target: bool = setting(
        True,
        "Start the fused layer from the target's last decoder layer (stored in the cache) and fc as a "
        "pass-through of the last aux state; off (or a cache without that layer): random init.",
    )
    mask_token_id: int | None = setting(
        None,
        "Token fed at depth >= 1 slots (peagle only); default by rule: the tokenizer's mask token, an unused "
        "embedding row, else the lowest special token never seen in the data (docs/reference/algorithm.md).",
    )
    skip_corrupt: bool = setting(
        False, "Skip samples whose data fails its checksum (reported) instead of stopping."
    )
    max_bad_steps: int = setting(
        5, "Stop after this many consecutive steps with non-finite loss or gradients."
    )
    log_every: int = setting(10, "Log metrics every N steps.")
    report_to: str = setting(
        "tensorboard",
        f"Experiment trackers that receive the metrics, the resolved settings and the plots (rank 0), "
        f"comma-separated: {', '.join(TRACKERS)}; none for metrics.jsonl only. A resumed run continues its "
        "tracker runs (ids in RUN/trackers.json).",
    )
    export: bool = setting(
        True,
        "Export the speculators checkpoint (peagle or eagle3 format, as the method) at the end of training.",
    )

    def __post_init__(self) -> None:
        check_finite(self)
        check_device(self.device)
        require(self.cache, "cache", "--cache")
        require(self.output, "output", "--output")
        refuse_duplicate_paths([self.cache, *self.extra_cache], "cache and extra_cache name", "cache")
        check_positive(
            self,
            "draft_layers",
            "draft_vocab_size",
            "tokens_per_step",
            "grad_accum",
            "epochs",
            "sequence_partitions",
            "eval_every",
            "save_every",
            "keep_checkpoints",
            "loss_chunk",
            "max_bad_steps",
            "log_every",
        )
        if self.steps is not None and self.steps <= 0:
            raise BadConfig(f"steps must be positive, got {self.steps}")
        if self.mask_token_id is not None and self.mask_token_id < 0:
            raise BadConfig(f"mask_token_id must be a token id (>= 0), got {self.mask_token_id}")
        if self.lr <= 0:
            raise BadConfig(f"lr must be positive, got {self.lr}")
        if self.step_loss_decay <= 0:
            raise BadConfig(f"step_loss_decay must be positive, got {self.step_loss_decay}")
        if self.method == "eagle3" and self.sequence_partitions > 1:
            raise BadConfig(
                "sequence_partitions splits P-EAGLE's parallel chains; method eagle3 runs each row whole: "
                "use sequence_partitions 1 (and a smaller tokens_per_step, or grad_checkpointing, to cut memory)"
            )
        self.cod()  # depths, down_sample_ratio(_min) and max_anchors are checked by CODConfig
        self.trackers()
        for name in ("warmup", "eval_samples", "num_workers", "grad_clip", "weight_decay"):
            if getattr(self, name) < 0:
                raise BadConfig(f"{name} must be >= 0, got {getattr(self, name)}")

    def trackers(self) -> tuple[str, ...]:
        """The tracker names of `report_to`, in order, without repeats (() for none).

        Raises:
            BadConfig: a name that is not a tracker, or none beside a tracker.
        """
        names = tuple(dict.fromkeys(n.strip() for n in self.report_to.split(",") if n.strip()))
        if names == ("none",):
            return ()
        unknown = [n for n in names if n not in TRACKERS]
        if unknown or not names:
            why = (
                f"unknown tracker {unknown[0]!r}"
                if unknown and unknown[0] != "none"
                else "none with a tracker"
            )
            raise BadConfig(
                f"report_to {self.report_to!r}: {why if names else 'no tracker named'}; give a comma-separated "
                f"list of {', '.join(TRACKERS)}, or none"
            )
        return names

    def cod(self) -> CODConfig:
        """The COD sampling settings of this run (core.cod's own section)."""
        return CODConfig(
            depths=self.depths,
            ratio=self.down_sample_ratio,
            ratio_min=self.down_sample_ratio_min,
            max_anchors=self.max_anchors,
        )
