"""target/ of a cache: the target's config and tokenizer files copied as they are, and pieces.safetensors
(embedding, lm_head, final norm) -- what training needs of the target besides activations.

Writes files only; the tensors come from the caller (`TargetSource.load_pieces`, read by `model_dir.py`),
so this module never opens a model.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peagle_pipeline.cache import layout
from peagle_pipeline.runtime import atomic_copy, fsync_file, make_readable

__all__ = ["TargetSource", "save_target_pieces"]


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
    """

    source: str
    files: tuple[Path, ...]
    load_pieces: Callable[[], dict[str, Any]]
    init_layer: int | None = None


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
    fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{layout.PIECES_FILE}.", suffix=".tmp")
    os.close(fd)
    try:
        if target.init_layer is not None and any(k.startswith(layout.LAYER_PIECE_PREFIX) for k in pieces):
            import torch

            pieces = {**pieces, layout.LAYER_INDEX_KEY: torch.tensor([target.init_layer], dtype=torch.int64)}
        save_file(pieces, tmp, metadata={"source": target.source})  # one key: the bytes never vary
        make_readable(tmp)
        fsync_file(tmp)
        os.replace(tmp, out / layout.PIECES_FILE)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out
