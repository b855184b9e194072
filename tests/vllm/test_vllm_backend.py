"""VLLMBackend against HFBackend on the tiny Llama, in fp32, where both must agree to float precision.

fp32 removes bf16 rounding noise, so these tests pin the conventions exactly: unshifted rows (P_t from
prompt_logprobs[t+1], the last row from the sampled token), layer ids (including id L, the pre-norm output),
top-k order. A small `max_num_batched_tokens` forces chunked prefill on the long sample.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from agreement import compare
from conftest import TINY_LAYERS

LENGTHS = (1, 2, 17, 64, 150)  # 150 > max_num_batched_tokens: prefilled in chunks


def _cfg(model: Path, **kw):  # type: ignore[no-untyped-def]
    from peagle_pipeline.config import ExtractConfig

    base = dict(
        model=str(model),
        data=["unused"],
        output="unused",
        topk=8,
        last_hidden=True,
        max_length=256,
        device="cpu",
        dtype="fp32",
        max_num_batched_tokens=64,
    )
    base.update(kw)
    return ExtractConfig(**base)


@pytest.fixture(scope="module")
def batch() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(5, 400, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def backends(tiny_model: Path):  # type: ignore[no-untyped-def]
    from peagle_pipeline.backends.hf import HFBackend
    from peagle_pipeline.backends.vllm import VLLMBackend
    from peagle_pipeline.stages.extract.settings import backend_settings

    hf = HFBackend(backend_settings(_cfg(tiny_model)), TINY_LAYERS)
    vb = VLLMBackend(backend_settings(_cfg(tiny_model)), TINY_LAYERS)
    yield hf, vb
    vb.close()
    hf.close()


def test_fp32_outputs_match_hf(backends, batch) -> None:  # type: ignore[no-untyped-def]
    hf, vb = backends
    ref, got = hf.forward(batch), vb.forward(batch)
    for r, g, ids in zip(ref, got, batch, strict=True):
        T = len(ids)
        assert g.aux_hidden.shape == (T, len(TINY_LAYERS), 64) and g.aux_hidden.dtype == torch.float32
        assert g.topk_ids.shape == (T, 8) and g.topk_ids.dtype == torch.int64
        assert g.topk_logprobs.dtype == torch.float32 and g.last_hidden is not None
        assert torch.equal(r.topk_ids, g.topk_ids), f"top-k ids differ for a sample of {T} tokens"
        torch.testing.assert_close(g.topk_logprobs, r.topk_logprobs, atol=2e-4, rtol=0)
        torch.testing.assert_close(g.aux_hidden, r.aux_hidden, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(g.last_hidden, r.last_hidden, atol=1e-4, rtol=1e-4)
        # id L is the pre-norm output: the last aux column and last_hidden are the same tensor
        assert torch.equal(g.aux_hidden[:, -1], g.last_hidden)
        assert torch.all(g.topk_logprobs[:, :-1] >= g.topk_logprobs[:, 1:]), "top-k not in descending order"
    figures = compare(ref, got)
    assert figures["topk_overlap"] == 1.0 and figures["aux_rel"] < 1e-5


def test_results_do_not_depend_on_batching(backends, batch) -> None:  # type: ignore[no-untyped-def]
    _, vb = backends
    alone = vb.forward([batch[3]])[0]
    together = vb.forward(batch)[3]
    torch.testing.assert_close(alone.aux_hidden, together.aux_hidden, atol=1e-5, rtol=1e-5)
    assert torch.equal(alone.topk_ids, together.topk_ids)


def test_scratch_files_are_removed(backends, batch) -> None:  # type: ignore[no-untyped-def]
    _, vb = backends
    vb.forward(batch[:2])
    assert vb._storage.is_dir()
    assert list(vb._storage.iterdir()) == [], "per-request hidden-state files must be deleted after reading"


def test_returned_tokens_are_checked(backends) -> None:  # type: ignore[no-untyped-def]
    from peagle_pipeline.backends.vllm import VLLMMismatch

    _, vb = backends
    sent = [7, 8, 9, 10]
    out = vb.llm.generate([{"prompt_token_ids": sent}], vb._params, use_tqdm=False)[0]
    with pytest.raises(VLLMMismatch, match="prompt token ids differ"):
        vb._one([7, 8, 9, 11], out)


def test_parse_topk_rejects_wrong_row_sizes() -> None:
    from vllm.logprobs import FlatLogprobs

    from peagle_pipeline.backends.vllm import VLLMMismatch, parse_topk

    flat = FlatLogprobs(
        start_indices=[0, 0, 3],
        end_indices=[0, 3, 5],
        token_ids=[1, 2, 3, 4, 5],
        logprobs=[-1.0, -0.5, -2.0, -1.0, -0.1],
        ranks=[2, 1, 2, 3, 1],
        decoded_tokens=[None] * 5,
    )
    with pytest.raises(VLLMMismatch, match="expected 3"):
        parse_topk(flat, 2, 2)
    ids, lps = parse_topk(flat[:2], 2, 1)
    assert ids.tolist() == [[2, 3]] and lps.tolist() == [[-0.5, -2.0]]


def test_bad_layer_ids_and_topk_fail_before_engine_start(tiny_model: Path) -> None:
    from peagle_pipeline.backends.vllm import VLLMBackend
    from peagle_pipeline.errors import BadInput
    from peagle_pipeline.stages.extract.settings import backend_settings

    with pytest.raises(BadInput, match=r"layer ids \[7\] outside 0..6"):
        VLLMBackend(backend_settings(_cfg(tiny_model)), [2, 7])
    with pytest.raises(BadInput, match="exceeds the target vocabulary"):
        VLLMBackend(backend_settings(_cfg(tiny_model, topk=1000)), TINY_LAYERS)


def test_gpu_pinning_under_torchrun() -> None:
    from peagle_pipeline.backends.vllm import local_gpu_devices

    torchrun = {"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4", "RANK": "6", "WORLD_SIZE": "8"}
    assert local_gpu_devices(torchrun, 1) == "2"
    assert local_gpu_devices(torchrun, 2) == "4,5"
    assert local_gpu_devices({**torchrun, "CUDA_VISIBLE_DEVICES": "0"}, 1) is None  # SLURM/user choice wins
    assert local_gpu_devices({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}, 2) is None
    assert local_gpu_devices({}, 1) is None
