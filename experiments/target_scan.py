"""Which target architectures break: tiny random models of transformers model types run through the real CLI.

For each model type: a random model at the tiny test sizes (tests/tiny.py `build_tiny_causal_lm`), `extract` (HF,
fp32, with last hidden states) of a dozen chats, `train` on the top-k and on the exact target, and the checks a
user cannot see: the stored log-probs against the model's own, the exact target (from the cache's pieces, as the
trainer computes it) against the stored log-probs, and what the start from the target's last layer says. One line
per model type; the errors name the failing command. Minutes for the default list on 2 cores.

    .venv/bin/python experiments/target_scan.py [MODEL_TYPE ...] [--dir .scratch/target-scan]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

# Per model type, what its config needs beyond the tiny sizes (experts, MLA ranks, Granite's multipliers).
EXTRA: dict[str, dict] = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "granite": dict(
        embedding_multiplier=12.0, attention_multiplier=0.03, residual_multiplier=0.22, logits_scaling=8.0
    ),
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64
    ),
    "phimoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "glm4_moe": dict(
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        first_k_dense_replace=1,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
    ),
    "deepseek_v3": dict(
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=32,
        head_dim=16,
    ),
}
DEFAULT = [
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "granite",
    "granitemoe",
    "glm4",
    "glm4_moe",
    "olmo2",
    "smollm3",
    "cohere",
    "cohere2",
    "stablelm",
    "starcoder2",
    "phimoe",
    "nemotron",
    "deepseek_v3",
    "exaone4",
    "ernie4_5",
    "seed_oss",
    "ministral",
    "helium",
]
TRAIN = [
    *["--depths", "3", "--tokens-per-step", "128", "--steps", "2", "--eval-every", "2", "--save-every", "2"],
    *["--eval-samples", "2", "--precision", "fp32", "--num-workers", "0"],
]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "peagle_pipeline.cli", *args], capture_output=True, text=True
    )


def _last_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return lines[-1][:160] if lines else ""


def _errors(model: Path, cache: Path) -> tuple[float, float]:
    """(max |model's own log-prob - stored|, max |exact target's log-prob - stored|) on the first sample's top-k."""
    import torch
    from transformers import AutoModelForCausalLM

    from peagle_pipeline.cache.reader import open_cache
    from peagle_pipeline.model_dir import text_config

    reader = open_cache(str(cache))
    pieces, s = reader.target_pieces(), reader.read_sample(0)
    eps = text_config(reader.target_config()).get("rms_norm_eps", 1e-6)
    h = s.last_hidden.float()
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * pieces["norm.weight"].float()
    exact = torch.log_softmax(normed @ pieces["lm_head.weight"].float().T, -1)
    target = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    with torch.no_grad():
        own = torch.log_softmax(target(input_ids=s.input_ids[None]).logits[0].float(), -1)
    stored = s.topk_logprobs.float()
    return (
        float((own.gather(1, s.topk_ids) - stored).abs().max()),
        float((exact.gather(1, s.topk_ids) - stored).abs().max()),
    )


def scan(model_type: str, work: Path) -> str:
    from tiny import build_tiny_causal_lm, write_conversations

    shutil.rmtree(work, ignore_errors=True)
    try:
        model = build_tiny_causal_lm(work / "model", model_type, **EXTRA.get(model_type, {}))
    except Exception as err:  # a config this scan cannot build: say so and go on
        return f"{model_type}: not built ({type(err).__name__}: {str(err).splitlines()[0][:120]})"
    data = write_conversations(work / "conv.jsonl", 12)
    cache = work / "cache"
    extract = _cli(
        *["extract", "--model", str(model), "--data", str(data), "--output", str(cache), "--last-hidden"],
        *["--dtype", "fp32", "--max-length", "128", "--layers", "0,1,2"],
    )
    if extract.returncode:
        return f"{model_type}: extract exit {extract.returncode}: {_last_line(extract)}"
    own, exact = _errors(model, cache)
    parts = [f"{model_type}: own log-probs {own:.4f} off, exact target {exact:.4f} off"]
    for target in ("topk", "exact"):
        proc = _cli(
            "train",
            "--cache",
            str(cache),
            "--output",
            str(work / f"run-{target}"),
            *TRAIN,
            "--target",
            target,
        )
        out = (proc.stdout + proc.stderr).splitlines()
        start = next(
            (line for line in out if "starts from" in line or "no target layer" in line), "no start line"
        )
        parts.append(
            f"{target}: exit {proc.returncode} " + (_last_line(proc) if proc.returncode else start[:120])
        )
    return "; ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_types", nargs="*", default=DEFAULT)
    parser.add_argument("--dir", type=Path, default=ROOT / ".scratch" / "target-scan")
    args = parser.parse_args()
    for model_type in args.model_types:
        print(scan(model_type, args.dir / model_type), flush=True)


if __name__ == "__main__":
    main()
