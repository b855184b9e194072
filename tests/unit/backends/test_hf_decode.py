"""The HF decode loop (continuous batching, per-request sampling streams) against plain `model.generate` on a real
tiny Llama with grouped-query attention: prompts of mixed lengths, rows that stop early and slots that are refilled."""

from __future__ import annotations

import pytest
import torch

from peagle_pipeline.backends.generation import GeneratorSettings, SamplingSettings
from peagle_pipeline.backends.hf_generate import HFGenerator
from peagle_pipeline.backends.hf_sampling import next_tokens, request_uniforms

LENGTHS = [5, 17, 9, 30, 2, 11, 40, 3, 25, 8, 1, 14]


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 400, (n,), generator=g).tolist() for n in lengths]


def _generator(model, batch_size: int | None, loop: bool = True) -> HFGenerator:
    return HFGenerator(
        GeneratorSettings(
            model=str(model), dtype="fp32", device="cpu", batch_size=batch_size, decode_loop=loop
        )
    )


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    return tiny_model_factory(dtype="float32")


@pytest.fixture(scope="module")
def plain(model):
    be = _generator(model, 1, loop=False)
    yield be
    be.close()


def _stopping(plain: HFGenerator, prompts: list[list[int]]) -> SamplingSettings:
    """Greedy settings whose stop ids end several replies early, at different lengths (the rest run to the limit)."""
    free = SamplingSettings(0.0, 1.0, 1.0, 20, (3,))
    replies = [plain.generate([p], [0], free)[0].token_ids for p in prompts]
    stops = tuple(dict.fromkeys(replies[i][k] for i, k in ((0, 2), (3, 6), (6, 11))))
    return SamplingSettings(0.0, 1.0, 1.0, 20, stops)


@pytest.mark.parametrize("batch_size", [1, 3, 16])
def test_greedy_replies_are_those_of_model_generate(model, plain, batch_size):
    """Each prompt alone through model.generate is the reference; the loop runs them all at once with fewer slots
    than prompts (refills), mixed lengths (positions, masks) and early stops."""
    prompts = _prompts(LENGTHS)
    s = _stopping(plain, prompts)
    alone = [plain.generate([p], [i], s)[0] for i, p in enumerate(prompts)]
    lengths = sorted({len(r.token_ids) for r in alone})
    assert len(lengths) >= 3 and lengths[-1] == 20 and lengths[0] < 20  # early stops and full-length replies
    assert {r.finish for r in alone} == {"stop", "length"}
    loop = _generator(model, batch_size)
    assert loop.plain_reason is None  # the loop ran, not model.generate
    assert loop.generate(prompts, list(range(len(prompts))), s) == alone


def test_greedy_replies_equal_todays_batched_path(model, plain):
    """The loop against the previous HF path (model.generate in left-padded batches of 4) on the same call."""
    prompts = _prompts(LENGTHS, seed=3)
    s = _stopping(plain, prompts)
    before = _generator(model, 4, loop=False).generate(prompts, list(range(12)), s)
    assert _generator(model, 5).generate(prompts, list(range(12)), s) == before


def test_repetition_penalty_matches_model_generate(model, plain):
    prompts = _prompts(LENGTHS[:6], seed=5)
    s = SamplingSettings(0.0, 1.0, 1.5, 16, (3,))
    alone = [plain.generate([p], [0], s)[0] for p in prompts]
    assert alone != [plain.generate([p], [0], SamplingSettings(0.0, 1.0, 1.0, 16, (3,)))[0] for p in prompts]
    assert _generator(model, 2).generate(prompts, [0] * 6, s) == alone


def test_sampled_replies_follow_their_own_seed_not_the_batch(model):
    prompts = _prompts(LENGTHS, seed=1)
    seeds = [100 + i for i in range(12)]
    s = SamplingSettings(1.0, 0.9, 1.0, 16, (7, 9))
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    runs = [_generator(model, bs).generate(prompts, seeds, s) for bs in (1, 4, 12)]
    assert torch.equal(torch.rand(1), before)  # the caller's RNG stream is untouched
    assert runs[0] == runs[1] == runs[2]  # independent of how many run together (and of the refills)
    alone = _generator(model, 4).generate(prompts[5:6], seeds[5:6], s)
    assert alone == runs[0][5:6]  # a request alone gives the reply it gives among others
    other = _generator(model, 4).generate(prompts, seeds[:5] + [999] + seeds[6:], s)
    assert other[5] != runs[0][5] and other[:5] == runs[0][:5]
    assert len({len(r.token_ids) for r in runs[0]}) > 1  # sampled stops end some replies early


def test_sampler_draws_the_nucleus_with_transformers_probabilities():
    """Evenly spaced uniforms reproduce the distribution of transformers' temperature + top-p warpers exactly
    (to one count per token)."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0)) * 0.5
    for top_p in (1.0, 0.8):
        s = SamplingSettings(0.7, top_p, 1.0, 4, (0,))
        warped = TopPLogitsWarper(top_p)(None, TemperatureLogitsWarper(0.7)(None, logits.clone()))
        probs = warped.softmax(dim=-1)[0]  # [50]
        n = 20_000
        u = (torch.arange(n, dtype=torch.float32) + 0.5) / n
        picks = next_tokens(logits.expand(n, -1), u, s)
        counts = torch.bincount(picks, minlength=50).float()
        assert (counts - probs * n).abs().max() <= 1.5
        assert set(picks.tolist()) <= set(
            torch.nonzero(probs).flatten().tolist()
        )  # never outside the nucleus
    assert 0 < int((probs == 0).sum()) < 49  # the last top-p cut something and kept several tokens


def test_greedy_and_uniform_streams():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0]])
    assert next_tokens(logits, torch.zeros(1), SamplingSettings(0.0, 1.0, 1.0, 4, (0,))).tolist() == [1]
    assert torch.equal(request_uniforms(5, 8), request_uniforms(5, 8))
    assert not torch.equal(request_uniforms(5, 8), request_uniforms(6, 8))
    assert torch.equal(
        request_uniforms(5, 8)[:4], request_uniforms(5, 4)
    )  # a longer reply extends the stream


def test_sliding_window_models_go_through_model_generate(tmp_path):
    """The loop's full-attention mask would be wrong past a sliding window: such a model falls back to
    model.generate, and its greedy replies are still those of each prompt alone."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        sliding_window=8,
    )
    torch.manual_seed(0)
    MistralForCausalLM(config).save_pretrained(str(tmp_path))
    be = _generator(tmp_path, 3)
    assert be.plain_reason is not None and "sliding" in be.plain_reason
    prompts = _prompts([20, 3, 12, 7], seed=2)
    s = SamplingSettings(0.0, 1.0, 1.0, 10, (3,))
    alone = [_generator(tmp_path, 1).generate([p], [0], s)[0] for p in prompts]
    assert be.generate(prompts, [0, 1, 2, 3], s) == alone
