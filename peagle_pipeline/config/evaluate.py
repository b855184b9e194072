"""EvaluateConfig: the settings of `peagle-pipeline evaluate` (flags only; no pipeline-file section)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Literal

from peagle_pipeline.config.checks import check_gpu_memory, template_kwargs
from peagle_pipeline.config.fields import (
    ALLOW_OTHER_TARGET_HELP,
    gpu_memory_setting,
    setting,
    template_kwargs_setting,
    tensor_parallel_setting,
)
from peagle_pipeline.errors import BadInput

__all__ = ["EvaluateConfig", "K_LIST", "parse_depths"]

K_LIST = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")
"""A K list as `--depths` and `DIR@KLIST` take it: 4, 3,5, 3-5 or a mix (2,4-6)."""


def parse_depths(text: str) -> list[int]:
    """A K list (`K_LIST`): "4" -> [4], "3,5" -> [3, 5], "3-5" -> [3, 4, 5]; sorted, each K once.

    Raises:
        BadInput: not such a list, a K below 1 or a range that runs backwards.
    """
    if not K_LIST.match(text):
        raise BadInput(f"K list {text!r}: give K as 4, a list 3,5 or a range 3-5")
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        a, b = int(lo), int(hi or lo)
        if a < 1 or b < a:
            raise BadInput(f"K list {text!r}: every K must be >= 1, and a range a-b needs a <= b")
        out.update(range(a, b + 1))
    return sorted(out)


@dataclass(frozen=True, kw_only=True, slots=True)
class EvaluateConfig:
    """Settings of `peagle-pipeline evaluate` (flags only; no pipeline-file section). Every figure in the report
    carries them. Its checks raise `BadInput` naming the flag."""

    drafts: list[str] = setting(
        [],
        "Exported draft directories (P-EAGLE or EAGLE-3, as their config.json says), measured side by side; "
        "DIR@KLIST measures one at its own K list (DIR@4, DIR@3,5, DIR@4-8), an engine per K.",
        required=True,
        argument=True,
    )
    target: str | None = setting(None, "Target model directory (default: the verifier the draft names).")
    prompts: list[str] = setting(
        ["mt-bench"],
        "Prompt set, repeatable: mt-bench (80 first turns), humaneval (164 problems), heldout:RUN_DIR (the run's "
        "held-out split), or a file (JSONL of {'prompt': ...} or chat data).",
    )
    num_prompts: int = setting(80, "Prompts per set (the first ones).")
    max_tokens: int = setting(256, "Most new tokens generated per prompt.")
    temperature: float = setting(0.0, "Sampling temperature (0 = greedy).")
    depths: str | None = setting(
        None,
        "K = num_speculative_tokens of every draft without its own DIR@KLIST: one K (4), a list (3,5) or a range "
        "(4-8), an engine per K (default: each draft's own K).",
        metavar="KLIST",
    )
    concurrency: list[int] = setting([1], "Requests in flight for the tokens/s figures, repeatable.")
    acceptance_concurrency: int = setting(
        1,
        "Requests in flight in the run AL is read from (1 = one prompt at a time, as peers report; more is faster "
        "on many prompts, with the same AL up to numerics).",
    )
    output: str | None = setting(None, "Directory for report.json and acceptance.png (default: print only).")
    dtype: Literal["auto", "bf16", "fp32"] = setting(
        "auto",
        "Model dtype in vLLM; auto = bf16 on a GPU or a CPU whose bf16 units run it faster (AMX, or AVX512-BF16 on AMD), else fp32.",
    )
    seed: int = setting(0, "Sampling seed of prompt i is seed + i (T > 0).")
    chat_template_kwargs: dict[str, Any] = template_kwargs_setting()
    tensor_parallel_size: int = tensor_parallel_setting()
    gpu_memory_utilization: float = gpu_memory_setting()
    allow_other_target: bool = setting(False, ALLOW_OTHER_TARGET_HELP)

    def __post_init__(self) -> None:
        if not self.drafts:
            raise BadInput("give at least one exported draft directory")
        if not self.prompts:
            raise BadInput(
                "give at least one prompt set (--prompts mt-bench, humaneval, heldout:RUN_DIR or a file)"
            )
        for name in ("num_prompts", "max_tokens", "tensor_parallel_size"):
            if getattr(self, name) <= 0:
                raise BadInput(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.depths is not None:
            object.__setattr__(self, "depths", str(self.depths))  # `depths=4` from Python code
            try:
                parse_depths(self.depths)
            except BadInput as err:
                raise BadInput(f"--depths: {err}") from None
        if not self.concurrency or min(self.concurrency) <= 0:
            raise BadInput(f"--concurrency must be positive, got {self.concurrency}")
        if self.acceptance_concurrency <= 0:
            raise BadInput(f"--acceptance-concurrency must be positive, got {self.acceptance_concurrency}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise BadInput(f"--temperature must be >= 0, got {self.temperature}")
        if self.dtype not in ("auto", "bf16", "fp32"):
            raise BadInput(f"--dtype must be auto, bf16 or fp32, got {self.dtype!r}")
        check_gpu_memory(self)
        object.__setattr__(self, "chat_template_kwargs", template_kwargs(self.chat_template_kwargs))

    @property
    def depth_list(self) -> list[int] | None:
        """The K list of `--depths` (None: each draft's own K)."""
        return None if self.depths is None else parse_depths(self.depths)

    @property
    def levels(self) -> list[int]:
        """Every concurrency measured: the tokens/s levels and the one AL is read from."""
        return sorted(set(self.concurrency) | {self.acceptance_concurrency})
