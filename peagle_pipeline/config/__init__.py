"""Every setting of the stages, in one place: frozen dataclasses shared by CLI flags and pipeline files.

YAML keys equal flag names with `-` replaced by `_` (`--draft-vocab-size` <-> `draft_vocab_size`), flat under
`generate:` / `extract:` / `train:`. Precedence: default < pipeline file < flag, applied by `resolve()`. Each field's `help`
metadata is its one-line documentation (the CLI help and docs/reference/pipeline-files.md are generated from it).
"""

from __future__ import annotations

from peagle_pipeline.config.describe import describe_fields, field_choices, is_required
from peagle_pipeline.config.evaluate import EvaluateConfig
from peagle_pipeline.config.extract import ExtractConfig
from peagle_pipeline.config.generate import GenerateConfig
from peagle_pipeline.config.pipeline_file import SECTIONS, load_section, resolve, to_dict
from peagle_pipeline.config.target_stage import TargetStageConfig
from peagle_pipeline.config.train import TrainConfig
from peagle_pipeline.config.vllm_check import VllmCheckConfig
from peagle_pipeline.core.settings import SERVING_DEPTHS

__all__ = [
    "GenerateConfig",
    "ExtractConfig",
    "TrainConfig",
    "TargetStageConfig",
    "EvaluateConfig",
    "VllmCheckConfig",
    "resolve",
    "load_section",
    "to_dict",
    "describe_fields",
    "is_required",
    "field_choices",
    "SERVING_DEPTHS",
    "SECTIONS",
]
