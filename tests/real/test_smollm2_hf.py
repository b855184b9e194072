"""Real tier: the HF backend and chat rendering on SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised) with ShareGPT."""

from __future__ import annotations

import itertools

import pytest
import torch

from peagle_pipeline.backends.hf import HFBackend
from peagle_pipeline.cache.target import save_target_pieces
from peagle_pipeline.config import ExtractConfig
from peagle_pipeline.data.chat import ChatRenderer
from peagle_pipeline.data.formats import iter_rows
from peagle_pipeline.data.records import Conversation
from peagle_pipeline.model_dir import read_target_info
from peagle_pipeline.stages.extract.cache_output import target_source
from peagle_pipeline.stages.extract.settings import backend_settings

pytestmark = [pytest.mark.real, pytest.mark.slow]
MAX_TOKENS = 160  # keep CPU time small: two short real samples


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.fixture(scope="module")
def conversations(sharegpt_jsonl) -> list[Conversation]:
    rows = (r for r in iter_rows([sharegpt_jsonl]) if isinstance(r, Conversation))
    return list(itertools.islice(rows, 40))


def test_prepared_assets(smollm2_dir, sharegpt_jsonl):
    info = read_target_info(smollm2_dir)
    assert (info.num_hidden_layers, info.hidden_size, info.vocab_size) == (30, 576, 49152)
    with open(sharegpt_jsonl, encoding="utf-8") as f:
        assert sum(1 for _ in f) == 17671


def test_chatml_masks_on_real_conversations(tokenizer, conversations):
    renderer = ChatRenderer(tokenizer)
    checked = 0
    for conv in conversations[:25]:
        sample = renderer.render(conv.messages)
        spans, run = [], []
        for tid, m in zip(sample.input_ids + [None], sample.loss_mask + [False], strict=True):
            if m:
                run.append(tid)
            elif run:
                spans.append(tokenizer.decode(run))
                run = []
        replies = [
            m.content + "<|im_end|>"
            for m in conv.messages
            if m.role == "assistant"
            and any(p.role == "user" for p in conv.messages[: conv.messages.index(m)])
        ]
        assert spans == replies
        unsupervised = tokenizer.decode(
            [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if not m]
        )
        assert "<|im_start|>assistant\n" in unsupervised  # headers never supervised
        checked += 1
    assert checked == 25


@pytest.fixture(scope="module")
def backend(smollm2_dir):
    cfg = ExtractConfig(
        model=str(smollm2_dir),
        data=["unused"],
        output="unused",
        device="cpu",
        topk=32,
        topk_chunk=64,
        last_hidden=True,
    )
    be = HFBackend(backend_settings(cfg), [2, 15, 27, 30])
    yield be
    be.close()


def test_layer_convention_and_topk_on_real_samples(backend, tokenizer, conversations):
    renderer = ChatRenderer(tokenizer)
    batch = [renderer.render(c.messages).input_ids[:MAX_TOKENS] for c in conversations[:2]]
    batch[1] = batch[1][: MAX_TOKENS // 2]  # unequal lengths: right padding in the batch
    outs = backend.forward(batch)
    for ids, out in zip(batch, outs, strict=True):
        with torch.inference_mode():
            ref = backend.model(torch.tensor([ids]), output_hidden_states=True)
        hs = [h[0] for h in ref.hidden_states]
        for slot, k in enumerate((2, 15, 27)):
            torch.testing.assert_close(out.aux_hidden[:, slot].float(), hs[k].float(), rtol=2e-2, atol=2e-2)
        assert torch.equal(out.aux_hidden[:, 3], out.last_hidden)  # id L = pre-norm
        with torch.inference_mode():
            torch.testing.assert_close(
                backend.norm(out.last_hidden).float(), hs[30].float(), rtol=2e-2, atol=5e-2
            )
        top = torch.log_softmax(ref.logits[0].float(), -1).topk(32, dim=-1)
        torch.testing.assert_close(out.topk_logprobs, top.values, rtol=0, atol=0.1)  # batched vs alone: bf16
        agree = (out.topk_ids[:, 0] == top.indices[:, 0]).float().mean()
        assert agree > 0.97
    (alone,) = backend.forward([batch[0]])  # unpadded: equal to HF's own top-k up to fp32 rounding
    with torch.inference_mode():
        ref_logits = backend.model(torch.tensor([batch[0]])).logits[0]
    top = torch.log_softmax(ref_logits.float(), -1).topk(32, dim=-1)
    assert torch.equal(alone.topk_ids, top.indices)
    torch.testing.assert_close(alone.topk_logprobs, top.values, rtol=0, atol=5e-5)  # fp32 summation order


def test_pieces_of_tied_smollm2(smollm2_dir, backend, tmp_path):
    from safetensors.torch import load_file

    pieces = load_file(str(save_target_pieces(tmp_path, target_source(smollm2_dir)) / "pieces.safetensors"))
    emb = backend.model.get_input_embeddings().weight
    assert torch.equal(pieces["embed_tokens.weight"], emb) and torch.equal(pieces["lm_head.weight"], emb)
    assert torch.equal(pieces["norm.weight"], backend.norm.weight)


def test_bounded_rendering_is_identical_on_real_data(tokenizer, sharegpt_jsonl):
    """Rendering with max_tokens (memory bounded by the max length) gives exactly the first
    max_tokens ids and mask values of the whole rendering, on ShareGPT with SmolLM2's tokenizer (the bounded path
    is taken for every row longer than 16 characters per token wanted)."""
    from peagle_pipeline.data.chat import RejectRow

    renderer = ChatRenderer(tokenizer)
    rows = (r for r in iter_rows([sharegpt_jsonl]) if isinstance(r, Conversation))
    bounded = compared = 0
    for conv in itertools.islice(rows, 150):
        try:
            whole = renderer.render(conv.messages)
        except RejectRow as err:
            with pytest.raises(RejectRow) as again:
                renderer.render(conv.messages, max_tokens=65)
            assert again.value.reason == err.reason
            continue
        for n in (65, 257):
            cut = renderer.render(conv.messages, max_tokens=n)
            k = len(cut.input_ids)
            assert k >= min(n, len(whole.input_ids))
            assert cut.input_ids == whole.input_ids[:k] and cut.loss_mask == whole.loss_mask[:k]
            bounded += k < len(whole.input_ids)
            compared += 1
    assert compared > 250 and bounded > 100, (compared, bounded)
