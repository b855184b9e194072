"""backends.hf on a real tiny Llama: vLLM layer-id convention, true top-k log-probs, padding, determinism."""

from __future__ import annotations

import pytest
import torch

from peagle_pipeline.backends.hf import HFBackend
from peagle_pipeline.config import ExtractConfig
from peagle_pipeline.errors import BadInput
from peagle_pipeline.hardware import resolve_compute_dtype
from peagle_pipeline.stages.extract.settings import backend_settings

L = 6  # layers of the default tiny model


def make_backend(model, layer_ids=(0, 2, L), **kw) -> HFBackend:
    cfg = ExtractConfig(model=str(model), data=["unused"], output="unused", device="cpu", **kw)
    return HFBackend(backend_settings(cfg), list(layer_ids))


def random_batch(lengths, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 400, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def backend(tiny_model):
    be = make_backend(tiny_model, layer_ids=(0, 2, 3, L), topk=16, topk_chunk=5, last_hidden=True)
    yield be
    be.close()


def hf_reference(backend, ids: list[int]):
    """HF's own outputs for one unpadded sample: hidden_states tuple and logits [T, V]."""
    with torch.inference_mode():
        out = backend.model(torch.tensor([ids]), output_hidden_states=True)
    return [h[0] for h in out.hidden_states], out.logits[0]


def test_layer_ids_follow_vllm_convention(backend):
    (x,) = random_batch([11])
    (out,) = backend.forward([x])
    hidden, _ = hf_reference(backend, x)
    # the forward's dtype is the hardware's choice (auto: bf16 only where this CPU runs it faster), kept as computed
    expected = {"bf16": torch.bfloat16, "fp32": torch.float32}[resolve_compute_dtype("auto", "cpu")]
    assert out.aux_hidden.shape == (11, 4, 64) and out.aux_hidden.dtype == expected
    for slot, k in enumerate((0, 2, 3)):
        assert torch.equal(out.aux_hidden[:, slot], hidden[k])  # id k < L == hidden_states[k]
    # id L is the pre-norm output of the last layer; HF's hidden_states[L] is after the final norm.
    assert torch.equal(out.aux_hidden[:, 3], out.last_hidden)
    assert not torch.allclose(out.last_hidden.float(), hidden[L].float(), atol=1e-2)
    with torch.inference_mode():
        assert torch.equal(backend.norm(out.last_hidden), hidden[L])


def test_topk_equals_log_softmax_of_hf_logits(backend):
    (x,) = random_batch([13], seed=1)
    (out,) = backend.forward([x])
    _, logits = hf_reference(backend, x)
    ref = torch.log_softmax(logits.float(), dim=-1).topk(16, dim=-1)  # full vocab (512 > tokenizer's 400)
    assert out.topk_ids.dtype == torch.int64 and out.topk_logprobs.dtype == torch.float32
    assert torch.equal(out.topk_ids, ref.indices)
    torch.testing.assert_close(out.topk_logprobs, ref.values, rtol=0, atol=5e-5)
    assert bool((out.topk_logprobs[:, :-1] >= out.topk_logprobs[:, 1:]).all())  # descending
    assert float(out.topk_logprobs.exp().sum(-1).max()) <= 1.0 + 1e-5


@pytest.mark.parametrize("pass_mask", [False, True])
def test_padding_does_not_change_results(backend, pass_mask):
    batch = random_batch([17, 4, 9], seed=2)
    backend.pass_attention_mask = pass_mask  # causal-only (default) and classic padded-mask forward
    try:
        together = backend.forward(batch)
    finally:
        backend.pass_attention_mask = False
    for x, out in zip(batch, together, strict=True):
        (alone,) = backend.forward([x])
        assert out.aux_hidden.shape == alone.aux_hidden.shape == (len(x), 4, 64)
        assert out.topk_ids.shape == (len(x), 16) and out.last_hidden.shape == (len(x), 64)
        torch.testing.assert_close(out.aux_hidden.float(), alone.aux_hidden.float(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(out.topk_logprobs, alone.topk_logprobs, rtol=0, atol=5e-2)
        # identical leading choice wherever the alone run has a clear winner (bf16 tolerance)
        gap = alone.topk_logprobs[:, 0] - alone.topk_logprobs[:, 1]
        clear = gap > 0.1
        assert torch.equal(out.topk_ids[clear, 0], alone.topk_ids[clear, 0])


def test_same_batch_is_bit_identical(backend):
    batch = random_batch([9, 14], seed=3)
    a, b = backend.forward(batch), backend.forward(batch)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.aux_hidden, y.aux_hidden) and torch.equal(x.topk_ids, y.topk_ids)
        assert torch.equal(x.topk_logprobs, y.topk_logprobs) and torch.equal(x.last_hidden, y.last_hidden)


def test_bare_forward_is_the_plain_model_forward(backend):
    batch = random_batch([5, 8], seed=4)
    logits = backend.bare_forward(batch)
    assert logits.shape == (2, 8, 512)
    outs = backend.forward(batch)
    for b, x in enumerate(batch):
        ref = torch.log_softmax(logits[b, : len(x)].float(), -1).topk(16)
        torch.testing.assert_close(outs[b].topk_logprobs, ref.values, rtol=0, atol=5e-5)


def test_fp32_and_no_last_hidden(tiny_model):
    be = make_backend(tiny_model, layer_ids=(L - 3, 2), topk=4, dtype="fp32")
    assert be.layer_ids == [2, L - 3]  # ascending
    (out,) = be.forward(random_batch([6]))
    assert out.aux_hidden.dtype == torch.float32 and out.aux_hidden.shape == (6, 2, 64)
    assert out.last_hidden is None and out.topk_ids.shape == (6, 4)
    be.close()


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"layer_ids": (0, L + 1)}, "outside 0..6"),
        ({"layer_ids": ()}, "name at least one of 0..6"),
        ({"topk": 513}, "exceeds the target vocabulary"),
    ],
)
def test_bad_settings(tiny_model, kw, match):
    with pytest.raises(BadInput, match=match):
        make_backend(tiny_model, **kw)


def test_missing_model(tmp_path):
    with pytest.raises(BadInput, match="not found"):
        make_backend(tmp_path / "nope")


def test_two_batches_in_flight_give_forwards_outputs(backend):
    """`submit` queues a batch and returns its collector; two in flight, collected in order, are
    bit-identical to two plain forwards (padded rows left out by host-built indices, not a boolean mask)."""
    first, second = random_batch([9, 3, 14], seed=5), random_batch([6, 11], seed=6)
    want = backend.forward(first) + backend.forward(second)
    collect_first = backend.submit(first)
    collect_second = backend.submit(second)
    got = collect_first() + collect_second()
    assert len(got) == len(want) == 5
    for g, w in zip(got, want, strict=True):
        for name in ("aux_hidden", "topk_ids", "topk_logprobs", "last_hidden"):
            assert torch.equal(getattr(g, name), getattr(w, name)), name
    assert backend.submit([])() == []
