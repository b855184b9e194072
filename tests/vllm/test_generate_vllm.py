"""`peagle-pipeline generate` through vLLM (the default backend where vLLM is installed) on the tiny model that
ends its replies: rows follow the contract, and the same command gives the same bytes again. A few prompts of
~1,500 tokens put more than vLLM's default 4,096-token step budget in flight (on the CPU, seeded requests whose
prompt is prefilled in chunks crashed the worker before the workaround in backends/vllm_generate.py)."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import run_cli
from transformers import AutoTokenizer

FLAGS = [
    "--temperature",
    "1.0",
    "--top-p",
    "1.0",
    "--max-new-tokens",
    "24",
    "--samples-per-prompt",
    "2",
    "--chunk-size",
    "5",
    "--compute-dtype",
    "fp32",
    "--max-prompt-tokens",
    "2048",
]


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    runs, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def test_generate_with_vllm(tiny_stop_model: Path, tiny_chat_data: Path, tmp_path: Path, vllm_env):
    data = tmp_path / "chat.jsonl"
    long = "The quick brown fox jumps over the lazy dog. " * 80
    with data.open("w") as f:
        f.write(tiny_chat_data.read_text())
        for i in range(4):
            turns = [{"role": "user", "content": f"{i} {long}"}, {"role": "assistant", "content": "ok"}]
            f.write(json.dumps({"messages": turns}) + "\n")
    outs = []
    for name in ("a", "b"):
        out = tmp_path / name
        proc = run_cli(
            vllm_env,
            "generate",
            "--model",
            str(tiny_stop_model),
            "--data",
            str(data),
            "--output",
            str(out),
            *FLAGS,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "with vllm" in proc.stdout  # backend auto = vllm where it is installed
        # vLLM's own output (its WARNING lines, the traceback of its chat-template warm-up) goes to the log
        terminal = proc.stdout + proc.stderr
        assert "WARNING" not in terminal and "Traceback" not in terminal, terminal[-3000:]
        assert "vLLM's own messages go to " in proc.stderr  # (a temporary file: the output is new)
        assert "conversations" in proc.stderr  # our progress line per chunk (stderr is a pipe here)
        outs.append(out)
    a, b = outs
    meta = json.loads((a / "generate.json").read_text())
    assert meta["settings"]["backend"] == "vllm" and meta["format"] == "peagle-onpolicy/1"
    rows_a = (a / "rows-rank00000-of-00001.jsonl").read_bytes()
    assert rows_a == (b / "rows-rank00000-of-00001.jsonl").read_bytes()  # per-request seeds: reproducible

    tok = AutoTokenizer.from_pretrained(tiny_stop_model)
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    rows = [json.loads(line) for line in rows_a.decode().splitlines()]
    assert rows and {r["sample"] for r in rows} == {0, 1}
    assert sum(len(r["input_ids"]) > 1000 for r in rows) >= 4  # the long prompts were generated for
    assert any(len(r["finish"]) > 1 for r in rows) and any("stop" in r["finish"] for r in rows)
    for row in rows:
        ids, mask = row["input_ids"], row["loss_mask"]
        replies = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        runs = _runs(mask)
        assert len(ids) == len(mask) and len(runs) == len(replies) == len(row["finish"])
        for (s, e), text, finish in zip(runs, replies, row["finish"], strict=True):
            body = ids[s:e]
            if finish == "stop":
                assert body[-1] == eot
                body = body[:-1]
            else:
                assert len(body) == 24
            assert tok.decode(body) == text
