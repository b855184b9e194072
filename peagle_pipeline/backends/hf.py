"""Hugging Face transformers target backend: one batched forward per batch, aux states by hooks, chunked top-k.

Layer ids follow vLLM (docs/reference/algorithm.md): id k < L is the residual stream entering decoder layer k (a forward
pre-hook on that layer; id 0 = embeddings), id L is the last layer's output before the final norm (a pre-hook
on the norm). Logits are never materialised for the whole batch: the lm_head runs on the valid (unpadded)
tokens in chunks of `topk_chunk`, and only top-k ids and true log-probs (fp32 log-softmax over the full
vocabulary) are kept. Never keeps all layers (`output_hidden_states` is not used) and never writes files.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

import torch

from peagle_pipeline.backends.base import BackendSettings, SampleOutputs
from peagle_pipeline.core.target_convention import logit_scale
from peagle_pipeline.errors import BadInput
from peagle_pipeline.model_dir import check_target, text_config

__all__ = ["HFBackend", "resolve_device"]

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    """`auto` -> cuda when available, else cpu; otherwise the named device (checked to exist)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise BadInput(f"unknown device {name!r}; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BadInput(f"device {name!r} asked but CUDA is not available; use --device cpu")
    return device


def load_causal_lm(model_dir: str, dtype: torch.dtype) -> Any:
    """The target as a transformers causal LM in `dtype`; without a terminal, no "Loading weights" bar.

    A vision-language checkpoint that transformers maps to no causal LM (Qwen3-VL) loads as its image-text-to-text
    model, which runs text-only input as its language model does (with M-RoPE, text positions are the same on every
    axis: plain RoPE).

    Raises:
        BadInput: the model cannot be loaded (one line naming the cause), a quantised one's package missing included.
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if not sys.stderr.isatty():  # the bar, redrawn into a log, is only noise there
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    try:
        try:
            return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        except ValueError as err:
            if "Unrecognized configuration class" not in str(err):
                raise
            return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype)
    except (OSError, ValueError) as err:
        raise BadInput(f"cannot load target model {model_dir}: {str(err).splitlines()[0]}") from None
    except ImportError as err:  # a quantised checkpoint whose transformers integration needs another package
        raise BadInput(
            f"cannot load target model {model_dir} in transformers: {str(err).splitlines()[0]} "
            "(or use --backend vllm, which reads quantised checkpoints itself)"
        ) from None


def decoder_stack(model: Any) -> Any:
    """The module holding the decoder `layers` and final `norm`: the base model, or the language model of a
    vision-language one (`model.language_model`). Llama 4's text model names its checkpoint prefix
    (`language_model`) as its base but holds it as `model`."""
    base = getattr(model, model.base_model_prefix, None) or getattr(model, "model", model)
    inner = getattr(base, "language_model", None)
    return inner if inner is not None and getattr(base, "layers", None) is None else base


class HFBackend:
    """The target model in transformers, returning `SampleOutputs` in the cache's conventions.

    Args:
        cfg: the backend's settings (model, compute_dtype, device, topk, topk_chunk, last_hidden).
        layer_ids: aux layer ids (vLLM convention), each in 0..L.

    Raises:
        BadInput: bad layer ids, top-k larger than the vocabulary, unloadable model, unknown device.
    """

    def __init__(self, cfg: BackendSettings, layer_ids: list[int]) -> None:

        self.info, self.layer_ids = check_target(cfg.model, cfg.topk, layer_ids)
        L = self.info.num_hidden_layers
        self.topk = cfg.topk
        self.topk_chunk = cfg.topk_chunk
        self.want_last_hidden = cfg.last_hidden
        self.pass_attention_mask = False  # see forward(); True gives the classic padded-mask forward
        self.device = resolve_device(cfg.device)
        self.dtype = torch.bfloat16 if cfg.compute_dtype == "bf16" else torch.float32
        model = load_causal_lm(cfg.model, self.dtype)
        self.model = model.to(self.device).eval()  # type: ignore[arg-type]  # transformers' typed `to`
        self.base = decoder_stack(model)
        layers = getattr(self.base, "layers", None)
        self.norm = getattr(self.base, "norm", None)
        if layers is None or self.norm is None or len(layers) != L:
            raise BadInput(
                f"target {cfg.model}: unsupported architecture {self.info.architectures} (needs .layers and .norm)"
            )
        self.lm_head = model.get_output_embeddings()
        tc = text_config(self.info.config)
        self._softcap: float | None = tc.get("final_logit_softcapping")
        self._logit_scale = logit_scale(self.info.config)
        self._captured: dict[int, torch.Tensor] = {}
        self._ws: tuple[torch.Tensor, torch.Tensor | None] | None = None  # top-k workspace, see _workspace
        self._capturing = False
        self._hooks = [
            layers[k].register_forward_pre_hook(self._hook(k), with_kwargs=True)
            for k in self.layer_ids
            if k < L
        ]
        if L in self.layer_ids or self.want_last_hidden:
            self._hooks.append(self.norm.register_forward_pre_hook(self._hook(L), with_kwargs=True))

    def _hook(self, key: int):  # type: ignore[no-untyped-def]
        def pre_hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self._capturing:
                self._captured[key] = args[0] if args else kwargs["hidden_states"]  # [B, T, H]

        return pre_hook

    # ---------------------------------------------------------------------------------------------- API

    def forward(self, batch: list[list[int]]) -> list[SampleOutputs]:
        """Run one padded batch and return per-sample outputs trimmed to each sample's length (on CPU).

        Args:
            batch: B token-id lists (the runner decides batch composition; the result is deterministic given it).

        Returns:
            B SampleOutputs: aux_hidden [T_b, n_aux, H] (compute dtype), topk_ids [T_b, k] int64,
            topk_logprobs [T_b, k] float32 (row t = distribution of the token after x_t), last_hidden [T_b, H] or None.
        """
        return self.submit(batch)()

    def submit(self, batch: list[list[int]]) -> Callable[[], list[SampleOutputs]]:
        """Enqueue one batch (forward, top-k, device-to-host copies) without waiting for it; the returned call
        waits for the copies and gives `forward`'s outputs. On CUDA nothing here waits for the device, so the
        runner can enqueue batch i+1 before it writes batch i; on CPU the work is done here and the copies are
        no-ops. Per-sample outputs are the same either way (same kernels, same rows)."""
        if not batch:
            return list
        input_ids, attention_mask, lengths = self._pad(batch)
        rows = self._valid_rows(lengths, input_ids.shape[1])  # [N] flat indices of the valid tokens
        L = self.info.num_hidden_layers
        with torch.inference_mode():
            self._captured.clear()
            self._capturing = True
            try:
                # Right padding + causal attention: a valid position only ever sees valid positions, so the
                # padding mask changes nothing we keep; leaving it out lets attention take the plain causal path
                # (about 10% less CPU time on SmolLM2); results agree within bf16 rounding (tested both ways).
                mask_arg = attention_mask.to(self.device) if self.pass_attention_mask else None
                out = self.base(input_ids=input_ids, attention_mask=mask_arg, use_cache=False)
            finally:
                self._capturing = False
            final = _gather(out.last_hidden_state, rows)  # [N, H] after the final norm, valid tokens only
            topk_ids, topk_lp = self._topk(final)  # [N, k], [N, k]
            aux = torch.stack(
                [_gather(self._captured[k], rows) for k in self.layer_ids], dim=1
            )  # [N, n_aux, H]
            last = _gather(self._captured[L], rows) if self.want_last_hidden else None  # [N, H]
            self._captured.clear()
            copies = _HostCopies([aux, topk_ids, topk_lp] + ([last] if last is not None else []))

        def collect() -> list[SampleOutputs]:
            host = copies.wait()
            aux, ids, lp = (t.split(lengths) for t in host[:3])
            last = host[3].split(lengths) if len(host) > 3 else [None] * len(lengths)
            return [
                SampleOutputs(aux_hidden=a, topk_ids=i, topk_logprobs=p, last_hidden=h)
                for a, i, p, h in zip(aux, ids, lp, last, strict=True)
            ]

        return collect

    def bare_forward(self, batch: list[list[int]]) -> torch.Tensor:
        """The comparator of the extraction benchmark: the plain `model(input_ids)` forward (full [B, T, V]
        logits, no top-k, no copies) over the same padded batch, with the same attention path as `forward`
        (mask passed only when `pass_attention_mask`), so the ratio measures extraction overhead only. Like
        `submit`, it does not wait for the device: the caller synchronises where it times."""
        input_ids, attention_mask, _ = self._pad(batch)
        mask_arg = attention_mask.to(self.device) if self.pass_attention_mask else None
        with torch.inference_mode():
            return self.model(input_ids=input_ids, attention_mask=mask_arg, use_cache=False).logits

    def close(self) -> None:
        """Remove the hooks and drop the model."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._captured.clear()
        self._ws = None
        self.model = self.base = self.lm_head = self.norm = None  # type: ignore[assignment]
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------------------------------ helpers

    def _pad(self, batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Right-pad to the longest sample: ids [B, T] int64 (pad id 0) on the device, attention mask [B, T] int64
        on the host (the forward takes it only with `pass_attention_mask`), lengths."""
        lengths = [len(x) for x in batch]
        if min(lengths) == 0:
            raise ValueError("empty sample in batch")
        T = max(lengths)
        ids = torch.zeros(len(batch), T, dtype=torch.long)
        mask = torch.zeros(len(batch), T, dtype=torch.long)
        for b, x in enumerate(batch):
            ids[b, : len(x)] = torch.as_tensor(x, dtype=torch.long)
            mask[b, : len(x)] = 1
        return _to_device(ids, self.device), mask, lengths

    def _valid_rows(self, lengths: list[int], T: int) -> torch.Tensor:
        """[N] int64 indices of the valid (unpadded) tokens in the flattened [B * T] batch, on the device.

        Built on the host from the lengths: a boolean-mask index on the device would wait for it (nonzero)."""
        rows = torch.cat([torch.arange(n, dtype=torch.long) + b * T for b, n in enumerate(lengths)])
        return _to_device(rows, self.device)

    def _topk(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k of log_softmax(lm_head(hidden)) in fp32, `topk_chunk` tokens at a time.

        The logits of a chunk are the same bf16 (or fp32) matmul HF computes, written into a reused workspace
        (fresh [chunk, V] allocations page-fault on every call and cost more than the math); the log-softmax
        normaliser is then taken in fp32: log p = (x - max) - log(sum(exp(x - max))), as torch.log_softmax does.

        Args:
            hidden: [N, H] final-norm output of the valid tokens.

        Returns:
            ids [N, k] int64 (descending log-prob) and log-probs [N, k] float32.
        """
        N, k = hidden.shape[0], self.topk
        ids = torch.empty(N, k, dtype=torch.long, device=hidden.device)
        logprobs = torch.empty(N, k, dtype=torch.float32, device=hidden.device)
        weight, bias = self.lm_head.weight, getattr(self.lm_head, "bias", None)  # [V, H], [V] | None
        chunk = min(self.topk_chunk, N)
        logits_ws, f32_ws = self._workspace(chunk, weight.shape[0], weight.dtype, hidden.device)
        for s in range(0, N, chunk):
            e = min(N, s + chunk)
            x = hidden[s:e]  # [c, H]
            logits = logits_ws[: e - s]  # [c, V]
            if bias is None:
                torch.mm(x, weight.t(), out=logits)
            else:
                torch.addmm(bias, x, weight.t(), out=logits)
            if self._logit_scale != 1.0:
                logits.mul_(self._logit_scale)
            if self._softcap:
                logits.div_(self._softcap).tanh_().mul_(self._softcap)
            values, idx = logits.topk(k, dim=-1)  # [c, k], descending; values[:, 0] is the row max
            values = values.float()
            row_max = values[:, :1].clone()  # [c, 1]
            shifted = logits if f32_ws is None else f32_ws[: e - s].copy_(logits)  # [c, V] fp32
            sum_exp = shifted.sub_(row_max).exp_().sum(dim=-1, keepdim=True)  # [c, 1]
            torch.sub(values.sub_(row_max), sum_exp.log_(), out=logprobs[s:e])
            ids[s:e] = idx
        return ids, logprobs

    def _workspace(
        self, rows: int, vocab: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Reused [rows, V] buffers: logits in the model dtype, and an fp32 copy unless the logits are fp32."""
        ws = self._ws
        if ws is None or ws[0].shape[0] < rows or ws[0].device != device:
            logits = torch.empty(rows, vocab, dtype=dtype, device=device)
            f32 = (
                None
                if dtype == torch.float32
                else torch.empty(rows, vocab, dtype=torch.float32, device=device)
            )
            self._ws = ws = (logits, f32)
        return ws


# ------------------------------------------------------------------------------------- host <-> device
def _gather(states: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[B, T, H] states -> [N, H], the rows at flat indices `rows` (what `states[valid]` gives, without a sync)."""
    return states.reshape(-1, states.shape[-1]).index_select(0, rows)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`: through pinned memory without waiting on CUDA; itself on the CPU."""
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


class _HostCopies:
    """Device tensors copied to the host without blocking: into pinned buffers, then one CUDA event.

    `wait()` blocks until the copies are done and returns them in pageable memory (the pinned buffers go back to
    torch's pinned-memory cache instead of living on in the cache writer's shard buffers). CPU tensors pass as
    they are."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        if tensors[0].device.type != "cuda":
            self.host, self.event = tensors, None
            return
        self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for dst, src in zip(self.host, tensors, strict=True):
            dst.copy_(src, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()

    def wait(self) -> list[torch.Tensor]:
        """The host tensors, once the copies are done."""
        if self.event is None:
            return self.host
        self.event.synchronize()
        return [t.clone() for t in self.host]
