"""stages.draft: the draft of a run built from a real tiny cache alone (pieces, token counts, tokenizer)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from peagle_pipeline.cache.reader import open_cache
from peagle_pipeline.config import ExtractConfig, TrainConfig
from peagle_pipeline.core import vocab
from peagle_pipeline.errors import BadConfig
from peagle_pipeline.stages.extract import stage as extract
from peagle_pipeline.stages.train import draft

TEXTS = ["hello world", "the quick brown fox", "capital of france is paris", "speculative decoding drafts"]


@pytest.fixture(scope="module")
def cache_dir(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("draft")
    data = root / "chat.jsonl"
    with open(data, "w", encoding="utf-8") as f:
        for i in range(8):
            q, a = TEXTS[i % 4], " ".join(TEXTS[(i + 1) % 4 :] * 2)
            f.write(
                json.dumps(
                    {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
                )
            )
            f.write("\n")
    cfg = ExtractConfig(
        model=str(tiny_model),
        data=[str(data)],
        output=str(root / "cache"),
        topk=8,
        dtype="fp32",
        batch_tokens=512,
    )
    extract.run(cfg)
    return root / "cache"


def _cfg(cache: Path, **over) -> TrainConfig:
    return TrainConfig(cache=str(cache), output="run", **over)


def test_the_draft_follows_the_cache_and_the_settings(cache_dir: Path) -> None:
    cache = open_cache(cache_dir)
    model, spec, keep = draft.build_draft(
        cache, _cfg(cache_dir, draft_vocab_size=64, draft_layers=2, depths=3)
    )
    assert keep is not None and keep.size == 64  # the 64 most frequent supervised tokens (and ids to fill up)
    assert model.lm_head.weight.shape == (64, cache.meta.hidden_size) and len(model.layers) == 2
    assert (spec.draft_vocab_size, spec.draft_layers, spec.depths) == (64, 2, 3)
    assert (
        spec.aux_layer_ids == cache.meta.aux_layer_ids
        and spec.verifier_name_or_path == cache.meta.target_name_or_path
    )
    pieces = cache.target_pieces()
    assert torch.equal(
        model.embed_tokens.weight.to(pieces["embed_tokens.weight"].dtype), pieces["embed_tokens.weight"]
    )
    again, _, _ = draft.build_draft(cache, _cfg(cache_dir, draft_vocab_size=64, draft_layers=2, depths=3))
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True)
    )
    other, _, _ = draft.build_draft(
        cache, _cfg(cache_dir, draft_vocab_size=64, draft_layers=2, depths=3, seed=1)
    )
    assert not torch.equal(model.mask_hidden, other.mask_hidden)  # the seed draws the random init


def test_the_draft_starts_from_the_stored_target_layer(cache_dir: Path, tiny_model: Path, caplog) -> None:
    from safetensors.torch import load_file

    from peagle_pipeline.core.target_init import target_init_layer

    cache = open_cache(cache_dir)
    index, tensors = cache.target_layer()
    assert index == target_init_layer(cache.meta.num_hidden_layers) == cache.meta.num_hidden_layers - 1
    weights = load_file(str(tiny_model / "model.safetensors"))
    for name, t in tensors.items():  # the cache holds that layer of the target as it is
        assert torch.equal(t, weights[f"model.layers.{index}.{name}"]), name
    H = cache.meta.hidden_size
    model, _, _ = draft.build_draft(cache, _cfg(cache_dir, draft_vocab_size=64, draft_layers=2))
    first = model.layers[0]
    assert torch.equal(first.mlp.down_proj.weight, tensors["mlp.down_proj.weight"].float())
    assert torch.equal(first.self_attn.k_proj.weight[:, H:], tensors["self_attn.k_proj.weight"].float())
    assert torch.equal(first.hidden_norm.weight, tensors["input_layernorm.weight"].float())
    assert not torch.equal(first.self_attn.k_proj.weight[:, :H], tensors["self_attn.k_proj.weight"].float())
    aux = torch.randn(3, model.cfg.aux_size)
    assert torch.equal(model.fc(aux), aux[:, -H:])  # fc passes the last aux state through
    off, _, _ = draft.build_draft(
        cache, _cfg(cache_dir, draft_vocab_size=64, draft_layers=2, init_from_target=False)
    )
    assert not torch.equal(off.layers[0].mlp.down_proj.weight, first.mlp.down_proj.weight)
    assert torch.equal(off.layers[1].mlp.down_proj.weight, model.layers[1].mlp.down_proj.weight)  # same seed


def test_a_cache_without_a_target_layer_keeps_the_random_init(
    cache_dir: Path, tmp_path: Path, caplog
) -> None:
    """Caches extracted before the layer was stored: training still runs, from random weights, and says so."""
    import shutil

    from safetensors.torch import load_file, save_file

    from peagle_pipeline.cache import layout

    old = tmp_path / "old"
    shutil.copytree(cache_dir, old)
    pieces_file = old / layout.TARGET_DIR / layout.PIECES_FILE
    pieces = {k: v for k, v in load_file(str(pieces_file)).items() if k in layout.PIECE_KEYS}
    save_file(pieces, str(pieces_file), metadata={"source": "old"})
    cache = open_cache(old)
    assert cache.target_layer() is None
    with caplog.at_level(logging.WARNING, logger="peagle_pipeline.stages.train.draft"):
        model, _, _ = draft.build_draft(cache, _cfg(old, draft_vocab_size=64))
    assert "stores no target layer" in caplog.text and "re-extract" in caplog.text
    new, _, _ = draft.build_draft(
        open_cache(cache_dir), _cfg(cache_dir, draft_vocab_size=64, init_from_target=False)
    )
    assert torch.equal(model.fc.weight, new.fc.weight)  # the random init, as with the setting off


def test_the_vocabulary_size_is_capped_only_when_not_asked_for(cache_dir: Path, caplog) -> None:
    cache = open_cache(cache_dir)
    V = cache.meta.vocab_size
    with caplog.at_level(logging.WARNING, logger="peagle_pipeline.stages.train.draft"):
        _, spec, keep = draft.build_draft(cache, _cfg(cache_dir))  # default 32000 > V = 512: capped
    assert spec.draft_vocab_size == V and keep is None and "exceeds the target vocabulary" in caplog.text
    with pytest.raises(
        BadConfig, match=f"draft_vocab_size 1000 is larger than the target vocabulary \\({V}\\)"
    ):
        draft.build_draft(cache, _cfg(cache_dir, draft_vocab_size=1000))
    with pytest.raises(BadConfig, match="target=exact needs last hidden states"):
        draft.build_draft(cache, _cfg(cache_dir, target="exact"))


def test_mask_token_override_and_rule(cache_dir: Path) -> None:
    cache = open_cache(cache_dir)
    rows = int(cache.target_pieces()["embed_tokens.weight"].shape[0])
    assert draft.choose_mask_token(cache, rows, 5).token_id == 5
    chosen = draft.choose_mask_token(cache, rows, None)
    # the tiny tokenizer has 400 tokens and the model 512 embedding rows: the first unused row
    assert (chosen.token_id, chosen.rule) == (len(cache.tokenizer()), "the first unused embedding row")
    assert draft.describe_mask_token(cache, chosen.token_id) == (
        f"mask token: id {chosen.token_id} (an unused embedding row), seen 0 times in the cached samples"
    )


def test_the_cache_keeps_the_tokenizer_facts_and_old_caches_fall_back_to_the_tokenizer(
    cache_dir: Path, tmp_path: Path
) -> None:
    """Extraction writes target/tokenizer_facts.json (what the mask-token rule needs of the tokenizer); a cache
    without it, or with it unreadable, gives the same facts and the same mask token from the tokenizer itself."""
    import shutil

    from peagle_pipeline.cache import layout
    from peagle_pipeline.cache.target import parse_tokenizer_facts, tokenizer_facts_bytes
    from peagle_pipeline.stages.tokenizer_facts import cache_tokenizer_facts, tokenizer_facts

    cache = open_cache(cache_dir)
    kept = cache.tokenizer_facts()
    tok = cache.tokenizer()
    assert kept is not None and kept == tokenizer_facts(tok)
    assert kept.length == len(tok) and set(kept.special_ids) == {
        i for i, t in tok.added_tokens_decoder.items() if t.special
    }
    assert tok.eos_token_id in kept.reserved_ids and kept.names[tok.eos_token_id] == tok.eos_token
    assert parse_tokenizer_facts(tokenizer_facts_bytes(kept)) == kept
    rows = int(cache.target_pieces()["embed_tokens.weight"].shape[0])
    for damage in (None, b"{not json", b'{"length": 3}'):
        old = tmp_path / f"old-{damage!r}"
        shutil.copytree(cache_dir, old)
        facts_file = old / layout.TARGET_DIR / layout.TOKENIZER_FACTS
        if damage is None:
            facts_file.unlink()
        else:
            facts_file.write_bytes(damage)
        old_cache = open_cache(old)
        assert old_cache.tokenizer_facts() is None and cache_tokenizer_facts(old_cache) == kept
        for override in (None, 5, 100, tok.eos_token_id):
            assert draft.choose_mask_token(old_cache, rows, override) == draft.choose_mask_token(
                cache, rows, override
            )
    # a name the facts do not hold (an ordinary token as an explicit mask token) comes from the tokenizer
    assert 100 not in kept.names
    assert draft.describe_mask_token(cache, 100).startswith(
        f"mask token: id 100 ({tok.convert_ids_to_tokens(100)}), seen"
    )


def test_tokenizer_facts_without_unused_rows_choose_the_first_unused_special_token() -> None:
    """core.vocab's worked example (SmolLM2: tokenizer = embedding = 49152 rows, no mask token): rule 4 on the facts."""
    facts = vocab.TokenizerFacts(
        length=49152,
        mask_id=None,
        special_ids=tuple(range(17)),
        reserved_ids=frozenset({0, 1, 2}),
        pad_id=2,
        eos_id=2,
        names={3: "<repo_name>"},
    )
    assert vocab.TokenizerFacts.from_dict(facts.to_dict()) == facts
    counts = torch.zeros(49152, dtype=torch.long)
    choice = vocab.choose_mask_token_id(facts, 49152, counts)
    assert (choice.token_id, choice.rule) == (3, "the lowest unused special token")
    counts[3] = 1  # seen in the data: the next one
    assert vocab.choose_mask_token_id(facts, 49152, counts).token_id == 4


def test_vocab_coverage() -> None:
    counts = torch.tensor([5, 0, 3, 2])
    assert draft.vocab_coverage(counts, None) == (10, 10)
    dv = vocab.build_draft_vocab(counts, 2)  # ids 0 and 2
    assert draft.vocab_coverage(counts, dv) == (8, 10)


def test_describe_vocab_coverage(cache_dir: Path) -> None:
    cache = open_cache(cache_dir)
    total = int(cache.token_counts().sum())
    line = draft.describe_vocab_coverage(cache, None)
    assert line == (
        f"draft vocabulary: {cache.meta.vocab_size} of {cache.meta.vocab_size} target tokens, covering 100.0% "
        f"of the {total} supervised tokens in the cache"
    )
