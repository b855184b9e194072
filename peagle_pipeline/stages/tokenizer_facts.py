"""A tokenizer's facts for the mask-token rule (`core.vocab.TokenizerFacts`), read from the loaded tokenizer.

Extraction has the tokenizer loaded anyway and keeps these facts in the cache; training reads them from there and
loads the tokenizer itself only for a cache written before that (`cache_tokenizer_facts`).
"""

from __future__ import annotations

from typing import Any

from peagle_pipeline.core.vocab import TokenizerFacts

__all__ = ["tokenizer_facts", "cache_tokenizer_facts"]


def tokenizer_facts(tok: Any) -> TokenizerFacts:
    """The facts of a transformers tokenizer `tok`: its length, special ids, the ids that are never a mask token by
    rule (bos/eos/pad/unk and what the chat template writes) and the names of the ids the rule can pick."""
    from peagle_pipeline.data.chat import template_token_ids

    by_role = {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id}
    reserved = by_role | template_token_ids(tok)
    special = sorted(i for i, t in tok.added_tokens_decoder.items() if t.special)
    named = set(special) | {
        i for i in (tok.mask_token_id, tok.pad_token_id, tok.eos_token_id) if i is not None
    }
    length = len(tok)
    return TokenizerFacts(
        length=length,
        mask_id=tok.mask_token_id,
        special_ids=tuple(special),
        reserved_ids=frozenset(i for i in reserved if i is not None),
        pad_id=tok.pad_token_id,
        eos_id=tok.eos_token_id,
        names={i: str(tok.convert_ids_to_tokens(i)) for i in named if 0 <= i < length},
    )


def cache_tokenizer_facts(cache: Any) -> TokenizerFacts:
    """The facts kept in `cache` (a Cache or CacheUnion), or, for a cache without them, its tokenizer's."""
    return cache.tokenizer_facts() or tokenizer_facts(cache.tokenizer())
