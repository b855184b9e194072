"""Sequence partitioning's memory: a segment's step costs little per element of key/value context, and the KL loss
holds one [chunk, Vd] logits buffer at a time (docs/guides/train.md, "Sequence partitioning").

Each workload runs in a fresh process and reads the kernel's peak RSS (VmHWM after /proc/self/clear_refs) with a
fixed glibc mmap threshold, so freed buffers are returned at once; the bounds leave about 2x margin both ways.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")

_PRELUDE = """
import json, sys
from pathlib import Path
import torch
torch.set_num_threads(1)
def rss(field="VmRSS"):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
def reset():
    Path("/proc/self/clear_refs").write_text("5")
"""

# One 16k-token sample, no deeper COD elements; the segment owns the last `own` positions (argv[1]) and reads the
# 16k before them as key/value context (as the last of many segments does). H 256, 4 query heads over 1 kv head, 3 aux states.
_CONTEXT = """
from bench.reference_step import tiny_draft, tiny_target_config
from peagle_pipeline.core.cod import CODLayout
from peagle_pipeline.core.partition import Segment, forward_segment
L, own = 16384, int(sys.argv[1])
cfg = tiny_target_config(hidden=256, heads=4, kv_heads=1, head_dim=64, vocab=1024, inter=512)
model, vocab, _ = tiny_draft(config=cfg, draft_vocab=512)
for p in model.parameters():
    if p.requires_grad:
        p.grad = torch.zeros_like(p)
pos = torch.arange(L)
lay = CODLayout(anchor=pos, depth=torch.zeros(L, dtype=torch.long), doc=torch.zeros(L, dtype=torch.long),
                position=pos, target=pos)
owned = torch.zeros(L, dtype=torch.bool)
owned[-own:] = True
seg = Segment(index=pos, owned=owned)
tokens = torch.randint(0, 1024, (L,))
aux = torch.randn(L, 3 * 256).to(torch.bfloat16)
reset()
base = rss()
hidden, _ = forward_segment(model, lay, seg, tokens, aux)
hidden.square().sum().backward()
print(json.dumps({"peak": rss("VmHWM") - base, "context": L - own}))
"""

_KL = """
from peagle_pipeline.core.loss import Counted, kl_topk
c, vd, H = 512, 32768, 64
hidden = torch.randn(c, H, requires_grad=True)
head = torch.randn(vd, H) * 0.1
ids = torch.randint(0, vd, (c, 8))
lp = torch.log_softmax(torch.randn(c, 8), -1)
valid = torch.ones(c, dtype=torch.bool)
depth = torch.zeros(c, dtype=torch.long)
reset()
base = rss()
out = kl_topk(hidden, head, ids, lp, Counted(valid, depth, 1), None, chunk=c)
print(json.dumps({"peak": rss("VmHWM") - base, "buffer": c * vd * 4}))
"""


def _run(body: str, *args: str) -> dict:
    root = Path(__file__).resolve().parents[3]
    env = {
        **os.environ,
        "MALLOC_MMAP_THRESHOLD_": "131072",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests"), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        [sys.executable, "-c", _PRELUDE + body, *args], check=True, capture_output=True, text=True, env=env
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("own,bound", [(128, 11000), (512, 12000)], ids=["one-query-block", "blocks"])
def test_segment_context_costs_few_bytes_per_element(own, bound):
    # At its peak (in backward) the step holds per context element layer 0's key and value and their gradients
    # (fp32, 1 kv head: 512 B each), the same expanded to the 4 query heads for SDPA (2 KB each), RoPE (512 B) and the
    # gathered aux row (bf16: 1.5 KB): 7.4 KB measured. Casting the aux rows to fp32 before the checkpoint (+3 KB),
    # recomputing the whole context's embeddings, fc output and norms at once in backward and keeping an fp32
    # expanded copy of every key and value for backward made it 15.2 KB.
    # With 4 query blocks (9.9 KB measured) each block expands and casts only the keys it reads, and backward
    # gathers them again; an fp32 copy of every key and value at the query heads, kept for backward, made it 13.0 KB
    # (with the other fixes in place).
    r = _run(_CONTEXT, str(own))
    per = r["peak"] / r["context"]
    assert per < bound, f"{per:.0f} bytes per context element"


def test_kl_chunk_holds_one_logits_buffer():
    # [512, 32768] fp32 logits are 2**26 bytes; log-softmax in place keeps one such buffer (the old out-of-place
    # log-softmax held two).
    r = _run(_KL)
    assert r["peak"] < 1.5 * r["buffer"], r["peak"] / r["buffer"]
