"""target/ of a cache: the target's config and tokenizer files copied as they are, pieces.safetensors
(embedding, lm_head, final norm) and tokenizer_facts.json -- what training needs of the target besides activations.

Writes files only; the tensors come from the caller (`TargetSource.load_pieces`, read by `model_dir.py`),
so this module never opens a model.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from peagle_pipeline.cache import layout
from peagle_pipeline.runtime import atomic_copy, atomic_write_bytes, fsync_file, make_readable

if TYPE_CHECKING:
    from peagle_pipeline.core.vocab import TokenizerFacts

__all__ = ["TargetSource", "save_target_pieces", "tokenizer_facts_bytes", "parse_tokenizer_facts"]


@dataclass(frozen=True)
class TargetSource:
    """Where target/ comes from.

    Attributes:
        source: the model directory, recorded in pieces.safetensors' metadata.
        files: files copied into target/ as they are (config.json and the tokenizer files present).
        load_pieces: returns {"embed_tokens.weight": [V, H], "lm_head.weight": [V, H], "norm.weight": [H]},
            optionally with decoder layer `init_layer`'s tensors under layout.LAYER_PIECE_PREFIX; called only when
            target/ is written.
        init_layer: the index of that decoder layer (stored as layout.LAYER_INDEX_KEY when its tensors came).
        tokenizer_facts: written as layout.TOKENIZER_FACTS when given.
    """

    source: str
    files: tuple[Path, ...]
    load_pieces: Callable[[], dict[str, Any]]
    init_layer: int | None = None
    tokenizer_facts: TokenizerFacts | None = None


def tokenizer_facts_bytes(facts: TokenizerFacts) -> bytes:
    """The content of layout.TOKENIZER_FACTS for `facts` (the same facts give the same bytes)."""
    return (json.dumps(facts.to_dict(), ensure_ascii=False) + "\n").encode()


def parse_tokenizer_facts(data: bytes) -> TokenizerFacts | None:
    """The facts in a layout.TOKENIZER_FACTS file's `data`, or None when it cannot be read as such (its reader then
    falls back to the tokenizer itself: a damaged derived file costs time, never a wrong mask token)."""
    from peagle_pipeline.core.vocab import TokenizerFacts

    try:
        return TokenizerFacts.from_dict(json.loads(data))
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def save_target_pieces(out_dir: str | os.PathLike[str], target: TargetSource) -> Path:
    """Write the target's files and pieces.safetensors into `out_dir` (created).

    Every file is written to a temporary name and renamed, so a crash never leaves a half file.

    Returns:
        `out_dir` as a Path.

    Raises:
        whatever `target.load_pieces` raises (BadInput for missing tensors).
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pieces = target.load_pieces()
    for path in target.files:
        atomic_copy(path, out / path.name)
    if target.tokenizer_facts is not None:
        atomic_write_bytes(out / layout.TOKENIZER_FACTS, tokenizer_facts_bytes(target.tokenizer_facts))
    fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{layout.PIECES_FILE}.", suffix=".tmp")
    os.close(fd)
    try:
        if target.init_layer is not None and any(k.startswith(layout.LAYER_PIECE_PREFIX) for k in pieces):
            import torch

            pieces = {**pieces, layout.LAYER_INDEX_KEY: torch.tensor([target.init_layer], dtype=torch.int64)}
        try:
            save_file(pieces, tmp, metadata={"source": target.source})  # one key: the bytes never vary
        except Exception as err:  # safetensors' own error type, even for a full disk: make that an OSError
            code = next(
                (c for c in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT) if f"os error {c})" in str(err)), 0
            )
            if code:
                raise OSError(code, os.strerror(code), tmp) from None
            raise
        make_readable(tmp)
        fsync_file(tmp)
        os.replace(tmp, out / layout.PIECES_FILE)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out
