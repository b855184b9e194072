"""HF extraction on CUDA against the CPU fp32 cache of the same model and data: an fp32 forward on CUDA equals it
to float precision, the default CUDA run (bf16 forward, stored bf16) within bf16 rounding."""

from __future__ import annotations

import torch
from gpu_helpers import extract_tiny

from peagle_pipeline.cache.reader import open_cache


def _compare(ref_dir, got_dir) -> dict[str, float]:
    ref, got = open_cache(ref_dir), open_cache(got_dir)
    ids = sorted(int(i) for i in ref.samples["sample_id"])
    assert ids == sorted(int(i) for i in got.samples["sample_id"])
    err = norm = agree = total = lp_err = 0.0
    for sid in ids:
        a, b = ref.read_sample(sid), got.read_sample(sid)
        assert torch.equal(a.input_ids, b.input_ids)
        x, y = a.aux_hidden.float(), b.aux_hidden.float()
        err += float((x - y).pow(2).sum())
        norm += float(x.pow(2).sum())
        agree += float((a.topk_ids[:, 0] == b.topk_ids[:, 0]).sum())
        total += a.topk_ids.shape[0]
        lp_err = max(
            lp_err, float((a.topk_logprobs[:, 0].float() - b.topk_logprobs[:, 0].float()).abs().max())
        )
    return {"aux_rel": (err / norm) ** 0.5, "top1_agree": agree / total, "top1_logprob_max_abs": lp_err}


def test_cuda_extraction_equals_the_cpu_fp32_cache(tiny_model, gpu_conversations, tiny_cache_cuda, tmp_path):
    cpu = extract_tiny(tiny_model, gpu_conversations, tmp_path / "cpu", "--device", "cpu", "--dtype", "fp32")
    cuda32 = extract_tiny(
        tiny_model, gpu_conversations, tmp_path / "c32", "--device", "cuda", "--dtype", "fp32"
    )
    assert open_cache(cpu).meta.compute_dtype == "float32"
    assert open_cache(tiny_cache_cuda).meta.compute_dtype == "bfloat16"
    fp32 = _compare(cpu, cuda32)
    assert fp32["aux_rel"] < 1e-4 and fp32["top1_agree"] >= 0.995, fp32  # near-ties may flip
    bf16 = _compare(cpu, tiny_cache_cuda)
    assert bf16["aux_rel"] < 2e-2 and bf16["top1_agree"] > 0.95 and bf16["top1_logprob_max_abs"] < 0.5, bf16


def _syncs(fn) -> int:
    """How many synchronizing CUDA calls `fn()` makes (torch's sync debug mode, as warnings)."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in seen)


def test_submit_waits_no_more_than_the_bare_forward(tiny_model):
    """Queuing a batch (forward, top-k, device-to-host copies) makes no host sync the model's own
    forward does not make; collecting it then gives the outputs of a plain `forward`."""
    from peagle_pipeline.backends.hf import HFBackend
    from peagle_pipeline.config import ExtractConfig
    from peagle_pipeline.stages.extract.settings import backend_settings

    cfg = ExtractConfig(model=str(tiny_model), data=["-"], output="-", device="cuda", last_hidden=True)
    backend = HFBackend(backend_settings(cfg), [2, 3, 6])
    batch = [list(range(5, 40)), list(range(7, 20)), list(range(3, 60))]
    ids = torch.tensor([x + [0] * (57 - len(x)) for x in batch], device="cuda")
    want = backend.forward(batch)
    with torch.inference_mode():
        bare = _syncs(lambda: backend.base(input_ids=ids, use_cache=False))
    collectors: list = []
    queued = _syncs(lambda: collectors.append(backend.submit(batch)))
    assert queued <= bare, (queued, bare)
    for got, ref in zip(collectors[0](), want, strict=True):
        assert got.aux_hidden.device.type == "cpu" and torch.equal(got.aux_hidden, ref.aux_hidden)
        assert torch.equal(got.topk_ids, ref.topk_ids) and torch.equal(got.last_hidden, ref.last_hidden)
    backend.close()
