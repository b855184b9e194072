"""Full caches written by `peagle-pipeline extract --backend hf` and `--backend vllm` agree (fp32, tiny Llama).

The caches come from the real CLI in subprocesses (conftest `tiny_caches`) and are compared through the reader API.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from conftest import TINY_LAYERS


def test_hf_and_vllm_caches_agree(tiny_caches: dict[str, Path]) -> None:
    from peagle_pipeline.cache.reader import open_cache

    hf, vl = open_cache(tiny_caches["hf"]), open_cache(tiny_caches["vllm"])
    assert hf.meta.aux_layer_ids == vl.meta.aux_layer_ids == TINY_LAYERS
    cols = ["sample_id", "source_row", "length", "num_supervised"]
    assert hf.samples[cols].equals(vl.samples[cols]) and len(hf.samples) == 12
    assert np.array_equal(hf.token_counts(), vl.token_counts())
    for sample_id in hf.samples["sample_id"].tolist():
        a, b = hf.read_sample(sample_id), vl.read_sample(sample_id)
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        torch.testing.assert_close(b.aux_hidden.float(), a.aux_hidden.float(), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(b.last_hidden.float(), a.last_hidden.float(), atol=1e-4, rtol=1e-4)
        assert torch.equal(a.topk_ids, b.topk_ids), f"sample {sample_id}: top-k ids differ"
        torch.testing.assert_close(b.topk_logprobs, a.topk_logprobs, atol=2e-3, rtol=1e-3)  # float16 storage
