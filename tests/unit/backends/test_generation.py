"""backends.generation helpers and the HF generation backend on a real tiny Llama: padding, seeding, stopping."""

from __future__ import annotations

import pytest
import torch

from peagle_pipeline.backends.generation import (
    GeneratedReply,
    GeneratorSettings,
    SamplingSettings,
    combine_seeds,
    request_seed,
    split_reply,
)
from peagle_pipeline.backends.registry import get_generation_backend
from peagle_pipeline.errors import BadConfig


def test_split_reply_cuts_after_the_first_stop():
    assert split_reply([5, 9, 2, 2, 2], (2,), 5) == GeneratedReply([5, 9, 2], "stop")
    assert split_reply([5, 9, 7], (2, 7), 3) == GeneratedReply([5, 9, 7], "stop")
    assert split_reply([5, 9, 4], (2,), 3) == GeneratedReply([5, 9, 4], "length")
    with pytest.raises(RuntimeError):
        split_reply([5, 9], (2,), 3)  # short without a stop: the runtime lost tokens


def test_seeds_are_stable_and_distinct():
    assert (
        request_seed(0, 1, 0, 0) == request_seed(0, 1, 0, 0) == 62379607
    )  # fixed forever: changing it changes every generated dataset
    seeds = {
        request_seed(s, r, n, t) for s in range(2) for r in range(20) for n in range(3) for t in range(3)
    }
    assert len(seeds) == 2 * 20 * 3 * 3 and max(seeds) < 2**31
    assert combine_seeds([1, 2]) != combine_seeds([2, 1])


def test_unknown_backend_is_a_config_error():
    with pytest.raises(BadConfig, match="choose hf or vllm"):
        get_generation_backend("tgi", GeneratorSettings(model="m", dtype="fp32"))


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 400, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def hf(tiny_model):
    be = get_generation_backend(
        "hf", GeneratorSettings(model=str(tiny_model), dtype="fp32", device="cpu", batch_size=4)
    )
    yield be
    be.close()


def test_left_padded_batches_give_each_prompt_its_own_greedy_reply(hf):
    """Greedy replies in a padded batch equal the replies of each prompt alone (padding is masked out)."""
    greedy = SamplingSettings(0.0, 1.0, 1.0, 12, (3,))
    prompts = _prompts([5, 17, 9, 30, 2, 11])
    together = hf.generate(prompts, list(range(6)), greedy)
    alone = [hf.generate([p], [i], greedy)[0] for i, p in enumerate(prompts)]
    assert together == alone
    assert all(r.finish == "length" and len(r.token_ids) == 12 for r in together)  # random weights: no stop
    assert len({tuple(r.token_ids) for r in together}) > 1


def test_sampling_is_seeded_and_leaves_the_global_rng_alone(hf):
    s = SamplingSettings(1.0, 1.0, 1.0, 10, (3,))
    prompts = _prompts([6, 8, 4], seed=1)
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = hf.generate(prompts, [1, 2, 3], s)
    assert torch.equal(torch.rand(1), before)  # the caller's RNG stream is untouched
    assert hf.generate(prompts, [1, 2, 3], s) == a
    assert hf.generate(prompts, [1, 2, 4], s) != a
