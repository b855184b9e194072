"""The cache an extract run writes: its metadata (cache.json, compared on resume), where its target/ comes from,
creating or checking its directory, and the error for an output that cannot be written.

Storage layout itself is `cache/`'s; this module only states what this run's cache is.
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import TYPE_CHECKING, Literal, NoReturn

from peagle_pipeline.cache import layout
from peagle_pipeline.cache.layout import CacheMeta
from peagle_pipeline.cache.location import prepare_cache
from peagle_pipeline.cache.target import TargetSource
from peagle_pipeline.config import ExtractConfig, to_dict
from peagle_pipeline.core import nf4
from peagle_pipeline.core.target_init import target_init_layer
from peagle_pipeline.errors import BadInput
from peagle_pipeline.stages.extract.batch_plan import DEFAULT_LENGTH_WINDOW
from peagle_pipeline.stages.extract.settings import ExtractPlan

if TYPE_CHECKING:
    from peagle_pipeline.core.vocab import TokenizerFacts

__all__ = ["LOGICAL_DTYPE", "build_meta", "target_source", "prepare_output", "raise_if_unwritable"]

# `--dtype` -> the logical hidden dtype cache.json records
LOGICAL_DTYPE: dict[Literal["bf16", "fp32", "fp8", "nf4"], str] = {
    "bf16": "bfloat16",
    "fp32": "float32",
    "fp8": layout.FP8,
    "nf4": layout.NF4,
}


def build_meta(plan: ExtractPlan) -> CacheMeta:
    """The cache metadata of this plan (compared field by field on resume): the recorded settings, the target's
    facts, the aux layers, the world size and the settled forward dtype.

    Raises:
        BadInput: a stored dtype that cannot pack this target's hidden size (nf4 needs a multiple of 32).
    """
    from peagle_pipeline import __version__, model_dir
    from peagle_pipeline.data.formats import dataset_fingerprint

    cfg, info = plan.cfg, plan.info
    if cfg.dtype == "nf4" and info.hidden_size % nf4.BLOCK:
        raise BadInput(
            f"--dtype nf4 needs a hidden size that is a multiple of {nf4.BLOCK}; this target's is "
            f"{info.hidden_size}: use --dtype fp8 or bf16"
        )

    return CacheMeta(
        target_name_or_path=str(Path(cfg.model).resolve()),
        target_architectures=list(info.architectures),
        target_config_sha256=model_dir.config_sha256(cfg.model),
        tokenizer_sha256=model_dir.tokenizer_sha256(cfg.model),
        chat_template_sha256=model_dir.chat_template_sha256(cfg.model),
        num_hidden_layers=info.num_hidden_layers,
        hidden_size=info.hidden_size,
        vocab_size=info.vocab_size,
        aux_layer_ids=list(plan.layer_ids),
        topk=cfg.topk,
        hidden_dtype=LOGICAL_DTYPE[cfg.dtype],
        compute_dtype=LOGICAL_DTYPE[plan.backend.compute_dtype],
        has_last_hidden=cfg.last_hidden,
        max_length=cfg.max_length,
        overlong=cfg.overlong,
        assistant_turns=cfg.assistant_turns,
        leading_assistant=cfg.leading_assistant,
        dataset_fingerprint=dataset_fingerprint(cfg.data, cfg.split),
        max_samples=cfg.max_samples,
        world_size=plan.world,
        shard_tokens=cfg.shard_tokens,
        chunk_tokens=cfg.chunk_tokens,
        compress=cfg.compress,
        length_window=cfg.length_window or DEFAULT_LENGTH_WINDOW,
        chat_template_kwargs=dict(cfg.chat_template_kwargs),
        extra={"backend": cfg.backend, "peagle_pipeline_version": __version__},
    )


def target_source(
    model: str, init_layer: int | None = None, tokenizer_facts: TokenizerFacts | None = None
) -> TargetSource:
    """Where a cache's target/ comes from: the model's config and tokenizer files, its pieces (read from its
    safetensors only when target/ is written), with decoder layer `init_layer` for the draft's initialisation, and
    the facts of its tokenizer that training needs.

    Raises:
        BadInput: missing model directory or config.json.
    """
    from peagle_pipeline import model_dir, target_weights

    return TargetSource(
        source=str(Path(model)),
        files=tuple(model_dir.target_files(model)),
        load_pieces=lambda: target_weights.load_target_pieces_from_model(model, init_layer),
        init_layer=init_layer,
        tokenizer_facts=tokenizer_facts,
    )


def prepare_output(
    cfg: ExtractConfig,
    meta: CacheMeta,
    root: str | None = None,
    tokenizer_facts: TokenizerFacts | None = None,
) -> Path:
    """Create or check the cache directory at cfg.output, or at `root` (an object store's staging directory)
    (`cache.location.prepare_cache`); a new target/ keeps `tokenizer_facts`.

    Raises:
        OutputExists, IncompatibleCache, ResumeMismatch: see `prepare_cache`.
    """
    import yaml

    settings = yaml.safe_dump({"extract": to_dict(cfg)}, sort_keys=False)
    init_layer = target_init_layer(meta.num_hidden_layers)
    return prepare_cache(
        root or cfg.output, meta, settings, target_source(cfg.model, init_layer, tokenizer_facts)
    )


def raise_if_unwritable(err: OSError, output: str) -> NoReturn:
    """A permission error or read-only file system under the output becomes `BadInput`; anything else re-raises."""
    if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        where = f" ({err.filename})" if err.filename else ""
        raise BadInput(
            f"cannot write the cache in {output}: {err.strerror}{where}; choose a writable --output"
        ) from None
    raise err
