"""The target model directory read without loading the model: its config, tokenizer, chat template and hashes.

`read_target_info` reads config.json only; `config_sha256`, `tokenizer_sha256` and `chat_template_sha256` are the
identity a cache records; `target_files` lists the config and tokenizer files a cache copies (`cache/target.py`
writes them). The few tensors training needs are read by `target_weights`. Never instantiates the model, never
writes.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from peagle_pipeline.errors import BadInput, from_os_error
from peagle_pipeline.target_info import TargetInfo, check_layer_ids, check_topk

__all__ = [
    "read_target_info",
    "model_folder",
    "read_config",
    "text_config",
    "config_sha256",
    "tokenizer_sha256",
    "chat_template_sha256",
    "read_chat_template",
    "load_tokenizer",
    "target_files",
    "check_target",
    "TOKENIZER_FILES",
]

CONFIG_FILE = "config.json"
# Files copied next to the pieces (whichever exist); the tokenizer loads from them alone.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def model_folder(model_path: str | os.PathLike[str]) -> Path:
    """`model_path` as a target model folder: a directory with a config.json.

    Raises:
        BadInput: the directory or its config.json is missing.
    """
    p = Path(model_path)
    if not p.is_dir():
        raise BadInput(f"target model directory not found: {p}")
    if not (p / CONFIG_FILE).is_file():
        raise BadInput(
            f"target model {p} has no config.json (a local Hugging Face model directory is needed)"
        )
    return p


def read_config(model_path: str | os.PathLike[str]) -> dict[str, Any]:
    """The model's config.json as a dict.

    Raises:
        BadInput: the directory or config.json is missing or not valid JSON.
    """
    path = model_folder(model_path) / CONFIG_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise BadInput(f"cannot read {path}: {str(err).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise BadInput(f"{path} is not a JSON object")
    return data


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language-model part of a config: `text_config` of multimodal models, else the config itself."""
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) and "num_hidden_layers" in inner else config


def read_target_info(model_path: str | os.PathLike[str]) -> TargetInfo:
    """Identity and sizes of the target from config.json (weights are not read, only checked to be readable).

    Raises:
        BadInput: missing directory/config, a config without layer count, hidden size or vocab size, or a weight
            file this process may not read (named as such: safetensors and transformers call it missing).
    """
    config = read_config(model_path)
    _check_weights_readable(model_folder(model_path))
    text = text_config(config)
    sizes: dict[str, int] = {}
    for key in ("num_hidden_layers", "hidden_size", "vocab_size"):
        value = text.get(key, config.get(key))
        if not isinstance(value, int) or value <= 0:
            raise BadInput(f"target config of {model_path} has no valid {key!r}; is it a decoder-only LM?")
        sizes[key] = value
    archs = config.get("architectures") or text.get("architectures") or []
    return TargetInfo(name_or_path=str(model_path), architectures=list(archs), config=config, **sizes)


def _check_weights_readable(model_dir: Path) -> None:
    """Open every safetensors file of `model_dir`: mode 0600 of another user is "permission denied" here."""
    for f in sorted(model_dir.glob("*.safetensors*")):
        try:
            open(f, "rb").close()  # noqa: SIM115 - opened only to see whether it can be
        except OSError as err:
            raise from_os_error(err) or BadInput(f"cannot open {f}: {err.strerror or err}") from None


# ------------------------------------------------------------------------------------------------ hashes


def config_sha256(model_path: str | os.PathLike[str]) -> str:
    """sha256 of config.json in canonical form (sorted keys, compact), so formatting changes do not count."""
    canon = json.dumps(read_config(model_path), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()


def tokenizer_sha256(model_path: str | os.PathLike[str]) -> str:
    """sha256 over the names and bytes of the tokenizer files present (chat template files excluded)."""
    p = model_folder(model_path)
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        if name.startswith("chat_template") or name == "generation_config.json":
            continue
        f = p / name
        if f.is_file():
            h.update(name.encode() + b"\0")
            h.update(_file_sha256(f).encode())
    return h.hexdigest()


def read_chat_template(model_path: str | os.PathLike[str]) -> str | None:
    """The chat template text: chat_template.jinja, chat_template.json or tokenizer_config.json, else None."""
    p = model_folder(model_path)
    jinja = p / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    for name, key in (("chat_template.json", "chat_template"), ("tokenizer_config.json", "chat_template")):
        f = p / name
        if f.is_file():
            try:
                value = json.loads(f.read_text(encoding="utf-8")).get(key)
            except (OSError, ValueError, AttributeError):
                continue
            if value:
                return value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return None


def load_tokenizer(model_path: str | os.PathLike[str]) -> Any:
    """The tokenizer (and chat template) of the model directory, as transformers loads it.

    Raises:
        BadInput: it cannot be loaded (one line: the first line of transformers' reason).
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_path))
    except Exception as err:  # transformers/tokenizers raise many types for a broken tokenizer
        why = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise BadInput(f"cannot load the tokenizer of {model_path}: {why}") from None


def chat_template_sha256(model_path: str | os.PathLike[str]) -> str:
    """sha256 of the chat template text ("" when the model has none)."""
    return hashlib.sha256((read_chat_template(model_path) or "").encode()).hexdigest()


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def target_files(model_path: str | os.PathLike[str]) -> list[Path]:
    """config.json and the tokenizer files present in the model directory (what a cache's target/ copies).

    Raises:
        BadInput: missing directory or config.json.
    """
    p = model_folder(model_path)
    return [p / name for name in (CONFIG_FILE, *TOKENIZER_FILES) if (p / name).is_file()]


def check_target(model: str, topk: int, layer_ids: list[int]) -> tuple[TargetInfo, list[int]]:
    """What every backend checks before loading weights: the target's config, the layer ids and top-k.

    Raises:
        BadInput: unreadable model config, a layer id outside 0..L, top-k larger than the vocabulary.
    """
    info = read_target_info(model)
    ids = check_layer_ids(list(layer_ids), info.num_hidden_layers)
    check_topk(topk, info.vocab_size)
    return info, ids
