"""On-policy data: regenerate the assistant replies of chat data with the target itself.

This rank's source rows are cut into chunks of `chunk_size`. A chunk is generated in waves (`chunk.py`): wave j
asks the backend for reply j of every conversation (and sample) still going, in one call, and the conversations
grow by token ids (`data/dialogue.py`). The finished chunk is committed (`data/onpolicy_files.py`, the format
`extract` reads back); a resumed run skips committed chunks and regenerates the next one exactly, because every
request's seed is a function of (seed, row, sample, turn) and a chunk's calls are a function of its rows. Never
branches on the backend name.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from peagle_pipeline.backends import vllm_log
from peagle_pipeline.backends.generation import (
    GenerationBackend,
    GeneratorSettings,
    SamplingSettings,
    vllm_installed,
)
from peagle_pipeline.backends.registry import get_generation_backend
from peagle_pipeline.config import GenerateConfig
from peagle_pipeline.data.dialogue import DialogueBuilder
from peagle_pipeline.data.onpolicy_files import (
    FORMAT,
    META_FILE,
    OnPolicyWriter,
    prepare_output,
    recorded_template_time,
    remove_new_output,
    rows_file,
)
from peagle_pipeline.data.records import rank_rows
from peagle_pipeline.errors import BadConfig, BadInput
from peagle_pipeline.hardware import resolve_compute_dtype
from peagle_pipeline.runtime import check_output_dir, writer_rank
from peagle_pipeline.stages.generate.chunk import generate_chunk
from peagle_pipeline.stages.rank_run import Progress, open_beside, run_rank, this_rank_rows

__all__ = ["run", "GenerateSummary", "resolve_backend", "resolve_stop_ids", "build_meta"]

log = logging.getLogger(__name__)


@dataclass
class GenerateSummary:
    """What one `generate` call did for its rank (the totals are of everything committed so far)."""

    output: str
    rows_file: str
    backend: str = ""
    rows: int = 0
    replies: int = 0
    generated_tokens: int = 0
    supervised_tokens: int = 0
    finish_length: int = 0
    rejects: dict[str, int] = field(default_factory=dict)
    new_tokens: int = 0
    elapsed_s: float = 0.0
    engine_s: float = 0.0
    already_complete: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of this call, without the engine start-up."""
        busy = self.elapsed_s - self.engine_s
        return self.new_tokens / busy if busy > 0 else 0.0

    def format(self) -> str:
        if self.already_complete:
            head = f"{self.rows_file} in {self.output} is already complete: nothing to do"
        else:
            head = (
                f"generated {self.rows_file} in {self.output} with {self.backend}: {self.new_tokens} new tokens "
                f"in {self.elapsed_s:.1f} s ({self.tokens_per_s:.1f} tokens/s after {self.engine_s:.1f} s start-up)"
            )
        lines = [
            head,
            f"rows {self.rows}, replies {self.replies} (finish=length {self.finish_length}), "
            f"generated tokens {self.generated_tokens}, supervised tokens {self.supervised_tokens}",
            f"rejects {sum(self.rejects.values())}"
            + "".join(f"\n  {n:6d}  {r}" for r, n in sorted(self.rejects.items(), key=lambda kv: -kv[1])),
        ]
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------- settings
def resolve_backend(requested: str) -> str:
    """`auto` -> vllm when installed, else hf (logged); hf/vllm pass through."""
    if requested != "auto":
        return requested
    name = "vllm" if vllm_installed() else "hf"
    log.info("generation backend: %s (auto)", name)
    return name


def resolve_stop_ids(model: str, renderer: Any) -> list[int]:
    """Ids that end a reply: the template's end-of-turn token, the generation config's and tokenizer's eos.

    Raises:
        BadInput: none can be found (the reply would never stop).
    """
    from peagle_pipeline.data.dialogue import template_end_of_turn_ids

    found: list[int] = list(template_end_of_turn_ids(renderer))
    gen_config = Path(model) / "generation_config.json"
    if gen_config.is_file():
        try:
            eos = json.loads(gen_config.read_text(encoding="utf-8")).get("eos_token_id")
        except (OSError, ValueError):
            eos = None
        found += [eos] if isinstance(eos, int) else [i for i in eos or [] if isinstance(i, int)]
    if renderer.tokenizer.eos_token_id is not None:
        found.append(int(renderer.tokenizer.eos_token_id))
    stops = list(dict.fromkeys(found))
    if not stops:
        raise BadInput(f"{model}: no end-of-turn or eos token found; replies could not stop")
    return stops


def build_meta(
    cfg: GenerateConfig, backend: str, dtype: str, world: int, stops: list[int], template_time: datetime
) -> dict[str, Any]:
    """generate.json: what the rows depend on (compared on resume; `info` is not compared, but its
    `template_time`, the chat template's "now", is given to the template again on resume)."""
    from peagle_pipeline import __version__, model_dir
    from peagle_pipeline.data.formats import dataset_fingerprint

    return {
        "format": FORMAT,
        "settings": {
            "turns": cfg.turns,
            # only when not the default, so outputs started before the setting existed resume unchanged
            **({"thinking": cfg.thinking} if cfg.thinking != "strip" else {}),
            **({"chat_template_kwargs": cfg.chat_template_kwargs} if cfg.chat_template_kwargs else {}),
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "repetition_penalty": cfg.repetition_penalty,
            "max_new_tokens": cfg.max_new_tokens,
            "max_prompt_tokens": cfg.max_prompt_tokens,
            "samples_per_prompt": cfg.samples_per_prompt,
            "seed": cfg.seed,
            "max_samples": cfg.max_samples,
            "chunk_size": cfg.chunk_size,
            # HF draws each request's tokens from its own stream (seeded by seed, row, sample, turn), so rows do not
            # depend on the batch size; outputs of the per-batch streams before are refused, not continued
            "sampling_streams": "per-request" if backend == "hf" else None,
            "backend": backend,
            "compute_dtype": dtype,
            "world_size": world,
        },
        "stop_token_ids": stops,
        "data_fingerprint": dataset_fingerprint(cfg.data, cfg.split),
        "target": {
            "config_sha256": model_dir.config_sha256(cfg.model),
            "tokenizer_sha256": model_dir.tokenizer_sha256(cfg.model),
            "chat_template_sha256": model_dir.chat_template_sha256(cfg.model),
        },
        "info": {
            "target_path": str(Path(cfg.model).resolve()),
            "data": [str(p) for p in cfg.data],
            "peagle_pipeline_version": __version__,
            "batch_size": cfg.batch_size,
            "template_time": template_time.isoformat(timespec="seconds"),
        },
    }


# ---------------------------------------------------------------------------------------------- chunks
def _chunks(items: Iterable[tuple[int, Any]], size: int) -> Iterator[list[tuple[int, Any]]]:
    it = iter(items)
    while chunk := list(itertools.islice(it, size)):
        yield chunk


# ------------------------------------------------------------------------------------------------- run
def run(cfg: GenerateConfig, echo: Callable[[str], None] | None = None) -> GenerateSummary:
    """Generate (or resume) this rank's rows in cfg.output. See the module docstring.

    Args:
        echo: where plain progress lines go when stderr is not a terminal (no tqdm bar then).

    Raises:
        BadInput, BadConfig, OutputExists, IncompatibleCache, ResumeMismatch, Busy, OutOfSpace, Interrupted (Ctrl-C), Terminated (SIGTERM).
    """
    from peagle_pipeline.data.chat import ChatRenderer
    from peagle_pipeline.data.formats import iter_rows, split_notes
    from peagle_pipeline.model_dir import load_tokenizer

    rank, world = writer_rank(cfg.rank, cfg.world_size)
    max_model_len = _max_model_len(cfg)
    iter_rows(cfg.data, cfg.split)  # checks every path before the output exists; reads nothing
    tokenizer = load_tokenizer(cfg.model)
    renderer = ChatRenderer(tokenizer, template_kwargs=cfg.chat_template_kwargs)
    stops = resolve_stop_ids(cfg.model, renderer)
    builder = DialogueBuilder(renderer, cfg.turns, stops, cfg.thinking)
    backend_name = resolve_backend(cfg.backend)
    dtype = _compute_dtype(cfg, backend_name)
    settings, sampling = _settings(cfg, dtype, max_model_len, stops)
    root = Path(cfg.output)
    summary = GenerateSummary(output=str(root), rows_file=rows_file(rank, world), backend=backend_name)
    summary.notes += split_notes(cfg.data, cfg.split)
    existed, fresh = root.exists(), not (root / META_FILE).exists()
    if backend_name == "vllm":  # vLLM's own output: OUTPUT/vllm.log, a temporary file until the output exists
        vllm_log.route_to(root if root.is_dir() else None)
    # A new output is stamped (generate.json: backend, compute dtype) only once its backend has started, so a
    # failed start (vLLM missing, no CUDA, ...) leaves nothing that would refuse the corrected command.
    backend = _start_new(cfg, root, settings, summary, rank, world) if fresh else None
    meta = build_meta(cfg, backend_name, dtype, world, stops, renderer.now)
    writer = open_beside(lambda: _open_output(root, meta, rank, world), backend)
    # every rank, and every resume, renders with the date the output was started with
    renderer.now = recorded_template_time(root) or renderer.now
    if writer.complete:
        writer.close()
        if backend is not None:
            backend.close()
        summary.already_complete = True
        return _totals(summary, writer)
    work = _ChunkWork(
        _Generation(cfg, builder, settings, sampling),
        writer,
        summary,
        (rank, world),
        backend,
        echo,
        lambda: remove_new_output(root, rank, world, existed),
    )
    run_rank(work, fresh=fresh, world=world)
    return _totals(summary, writer)


def _max_model_len(cfg: GenerateConfig) -> int:
    """The engine's context length: the longest prompt plus the longest reply.

    Raises:
        BadConfig: it exceeds the target's context (max_position_embeddings).
    """
    from peagle_pipeline.model_dir import read_target_info, text_config

    info = read_target_info(cfg.model)
    context = text_config(info.config).get("max_position_embeddings")
    max_model_len = cfg.max_prompt_tokens + cfg.max_new_tokens
    if context and max_model_len > context:
        raise BadConfig(
            f"max_prompt_tokens + max_new_tokens ({max_model_len}) exceeds the target's context ({context})"
        )
    return max_model_len


def _settings(
    cfg: GenerateConfig, dtype: str, max_model_len: int, stops: list[int]
) -> tuple[GeneratorSettings, SamplingSettings]:
    """What the backend starts with, and how it samples."""
    settings = GeneratorSettings(
        model=cfg.model,
        dtype=dtype,  # type: ignore[arg-type]
        device=cfg.device,
        max_model_len=max_model_len,
        batch_size=cfg.batch_size,
        tensor_parallel_size=cfg.tensor_parallel_size,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
    )
    sampling = SamplingSettings(
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        repetition_penalty=cfg.repetition_penalty,
        max_new_tokens=cfg.max_new_tokens,
        stop_token_ids=tuple(stops),
    )
    return settings, sampling


def _open_output(root: Path, meta: dict[str, Any], rank: int, world: int) -> OnPolicyWriter:
    """Create or check the output and open this rank's writer."""
    prepare_output(root, meta)
    return OnPolicyWriter(root, rank, world).open()


def _no_rows(cfg: GenerateConfig, writer: OnPolicyWriter) -> str:
    """The error for a run that kept no row, naming the most frequent reject reasons (as extract's)."""
    from peagle_pipeline.data.records import most_common_reasons

    data = ", ".join(cfg.data)
    top = most_common_reasons(writer.state["reject_reasons"])
    return f"nothing generated from {data}: every row was rejected ({top}); nothing was kept"


def _start_new(
    cfg: GenerateConfig,
    root: Path,
    settings: GeneratorSettings,
    summary: GenerateSummary,
    rank: int,
    world: int,
) -> GenerationBackend:
    """Start the backend of a new output, after the checks that need no engine: the output directory is usable
    and (a single rank) the data holds a row.

    Raises:
        OutputExists, BadInput (no rows), BadConfig (vLLM missing), and whatever the backend's start raises.
    """
    from peagle_pipeline.data.formats import iter_rows

    check_output_dir(root, META_FILE, "a generate output")
    if world == 1 and next(rank_rows(iter_rows(cfg.data, cfg.split), 0, 1, cfg.max_samples), None) is None:
        raise BadInput(f"no rows to generate from: {', '.join(cfg.data)} holds none; nothing was written")
    t0 = time.perf_counter()
    backend = get_generation_backend(summary.backend, settings)
    summary.engine_s = time.perf_counter() - t0
    return backend


def _compute_dtype(cfg: GenerateConfig, backend: str) -> Literal["bf16", "fp32"]:
    """`cfg.compute_dtype` settled for the device: under vLLM the engine's rule (`vllm_dtype.engine_compute_dtype`: bf16
    for a target its CPU backend runs only in bf16), else the hardware's choice (`resolve_compute_dtype`)."""
    device = _device_type(cfg.device, backend)
    if backend == "vllm":
        from peagle_pipeline.backends.vllm_dtype import engine_compute_dtype

        return engine_compute_dtype(cfg.compute_dtype, cfg.model, device)
    return resolve_compute_dtype(cfg.compute_dtype, device)


def _device_type(device: str, backend: str) -> str:
    import torch

    if backend == "vllm" or device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


@dataclass(frozen=True)
class _Generation:
    """How replies are generated: the settings, the prompt builder, the backend's start and its sampling."""

    cfg: GenerateConfig
    builder: DialogueBuilder
    settings: GeneratorSettings
    sampling: SamplingSettings


@dataclass
class _ChunkWork:
    """This rank's rows file as `run_rank` runs it: the chunk loop, committing each chunk.

    `backend` is the one started for a new output, or None (then the loop starts one at the first chunk that is
    not committed yet); `echo` takes the plain progress lines (no terminal); `remove` removes the new output when
    this (only) rank kept no row."""

    gen: _Generation
    writer: OnPolicyWriter
    summary: GenerateSummary
    rank_world: tuple[int, int]
    backend: GenerationBackend | None
    echo: Callable[[str], None] | None
    remove: Callable[[], None]

    def loop(self) -> None:
        cfg, writer, summary = self.gen.cfg, self.writer, self.summary
        rows = this_rank_rows(cfg.data, cfg.split, *self.rank_world, cfg.max_samples)
        progress = Progress(rows.total, writer.rows_path.stem, ("conv", "conversations"), self.echo)
        if self.backend is not None:  # started before the loop: its start counts as elapsed, not in the rate
            progress.start -= summary.engine_s
            progress.idle_s = summary.engine_s
        replies = 0

        def on_wave(n_replies: int, n_tokens: int) -> None:
            nonlocal replies
            replies += n_replies
            summary.new_tokens += n_tokens
            progress.set_tokens(summary.new_tokens, replies=replies)
            progress.bar.refresh()

        try:
            for k, chunk in enumerate(_chunks(rows.rows, cfg.chunk_size)):
                if k < writer.chunks_done:
                    progress.skip(len(chunk))
                    continue
                if self.backend is None:
                    t0 = time.perf_counter()
                    self.backend = get_generation_backend(summary.backend, self.gen.settings)
                    summary.engine_s = progress.idle_s = time.perf_counter() - t0
                writer.commit(
                    generate_chunk(chunk, self.gen.builder, self.backend, self.gen.sampling, cfg, on_wave)
                )
                progress.advance(len(chunk), f"{replies} replies")
        finally:
            progress.close()
            summary.elapsed_s = time.perf_counter() - progress.start

    def committed(self) -> str:
        return f"{self.writer.state['rows']} rows of {self.writer.rows_path.name}"

    def nothing_usable(self) -> str | None:
        return _no_rows(self.gen.cfg, self.writer) if self.writer.state["rows"] == 0 else None

    def finish(self) -> None:
        self.writer.finish()
        self.writer.close()

    def abort(self) -> None:
        self.writer.close()

    def remove_new(self) -> None:
        self.remove()

    def close_backend(self) -> None:
        if self.backend is not None:
            self.backend.close()


def _totals(summary: GenerateSummary, writer: OnPolicyWriter) -> GenerateSummary:
    st = writer.state
    summary.rows = st["rows"]
    summary.replies = st["replies"]
    summary.generated_tokens = st["generated_tokens"]
    summary.supervised_tokens = st["supervised_tokens"]
    summary.finish_length = st["finish_length"]
    summary.rejects = dict(st["reject_reasons"])
    return summary
