"""The HF decode loop with continuous batching: a fixed number of slots, each running one request at a time.

Requests wait in a queue, longest prompt first. Free slots are refilled from the queue in groups (one left-padded
prefill per group, written into the slots' KV rows from column 0); then every step decodes one token for all slots
at once over the shortest window of KV columns that holds every running row. A row that stops (a stop token, or
`max_new_tokens`) hands its slot back at once, so finished rows never hold a batch; when the queue is empty and at
most half of the slots still run, the running rows move to the front and the batch shrinks. Each request samples
from its own uniforms (`hf_sampling`), so its reply does not depend on the batch. Never writes files.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from peagle_pipeline.backends.generation import GeneratedReply, SamplingSettings, split_reply
from peagle_pipeline.backends.hf_sampling import next_tokens, request_uniforms
from peagle_pipeline.backends.hf_slots import SlotCache

__all__ = ["DecodeLimits", "DecodeGraphs", "decode_all"]

log = logging.getLogger(__name__)

WINDOW_STEP = 64  # attention windows are a multiple of this many columns (fewer distinct shapes)


@dataclass(frozen=True, slots=True)
class DecodeLimits:
    """How big the loop runs: slots decoded together, prompt tokens per prefill forward, and refill group size."""

    slots: int
    prefill_tokens: int
    refill_at: int
    cuda_graphs: bool = (
        False  # replay the full-batch decode forward as CUDA graphs, one per window (CUDA only)
    )


class _Slots:
    """Per-slot state on the device ([B] or [B, max_new]) with host mirrors of what the loop branches on."""

    def __init__(self, B: int, s: SamplingSettings, vocab: int | None, device: torch.device) -> None:
        self.B, self.n = B, B  # slots allocated, slots in the running batch (0..n-1)
        self.lens = torch.zeros(B, dtype=torch.long, device=device)  # KV columns filled
        self.ngen = torch.zeros(B, dtype=torch.long, device=device)  # tokens sampled
        self.last = torch.zeros(B, dtype=torch.long, device=device)  # the token fed next
        self.active = torch.zeros(B, dtype=torch.bool, device=device)
        self.out = torch.zeros(B, s.max_new_tokens, dtype=torch.long, device=device)
        self.u = torch.zeros(B, s.max_new_tokens, dtype=torch.float32, device=device)
        self.seen = (
            torch.zeros(B, vocab, dtype=torch.bool, device=device)
            if vocab is not None and s.repetition_penalty != 1.0
            else None
        )
        self.req = [-1] * B  # request index per slot, -1 = free
        self.host_lens = [0] * B

    def free(self) -> list[int]:
        return [b for b in range(self.n) if self.req[b] < 0]

    def running(self) -> int:
        return sum(r >= 0 for r in self.req[: self.n])


class DecodeGraphs:
    """CUDA graphs of the decode forward over all B slots, one per attention window. Every input the forward reads
    (the fed tokens, the lengths, the KV store) is updated in place, so a replay computes the step of the moment.
    A capture that fails turns the graphs off for the call (eager steps then)."""

    def __init__(self) -> None:
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.failed = False

    def logits(self, forward: Callable[[], torch.Tensor], window: int) -> torch.Tensor | None:
        """[B, V] logits of this step by replaying the window's graph (captured on first use), or None."""
        if self.failed:
            return None
        if window not in self.graphs:
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    forward()  # warm-up (writes the same KV the replay writes)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    out = forward()
                self.graphs[window] = (graph, out)
            except Exception as err:  # any capture failure: the eager step is still right
                log.warning(
                    "CUDA graph capture failed (%s); decoding without graphs", str(err).splitlines()[0]
                )
                self.failed = True
                return None
        graph, out = self.graphs[window]
        graph.replay()
        return out


def decode_all(
    model: torch.nn.Module,
    prompts: list[list[int]],
    seeds: list[int],
    s: SamplingSettings,
    limits: DecodeLimits,
    device: torch.device,
) -> list[GeneratedReply]:
    """One reply per prompt, in prompt order (see the module docstring)."""
    run = _Decoder(model, prompts, seeds, s, limits, device)
    st = run.st
    with torch.inference_mode():
        while run.queue or st.running():
            free = st.free()
            if run.queue and (len(free) >= min(limits.refill_at, len(run.queue)) or not st.running()):
                run.admit(free)
                continue
            if not run.queue and 2 * st.running() <= st.n and st.n > 1:
                _compact(st, run.cache)
            run.step()
    return [r for r in run.replies if r is not None]


class _Decoder:
    """One `decode_all` call: the model, the requests and their queue, the slots and their KV cache, the replies."""

    def __init__(
        self,
        model: torch.nn.Module,
        prompts: list[list[int]],
        seeds: list[int],
        s: SamplingSettings,
        limits: DecodeLimits,
        device: torch.device,
    ) -> None:
        n = len(prompts)
        self.model, self.prompts, self.seeds, self.s, self.limits = model, prompts, seeds, s, limits
        self.queue = deque(sorted(range(n), key=lambda i: (-len(prompts[i]), i)))
        B = max(1, min(limits.slots, n))
        capacity = max(len(p) for p in prompts) + s.max_new_tokens
        vocab = model.get_output_embeddings().weight.shape[0] if s.repetition_penalty != 1.0 else None  # type: ignore[operator]
        self.st = _Slots(B, s, vocab, device)
        self.cache = SlotCache(B, capacity)
        self.stops = torch.tensor(s.stop_token_ids, dtype=torch.long, device=device)
        self.columns = torch.arange(capacity, device=device)
        self.replies: list[GeneratedReply | None] = [None] * n
        self.graphs = DecodeGraphs() if limits.cuda_graphs and device.type == "cuda" else None

    def admit(self, free: list[int]) -> None:
        """Prefill as many queued requests as there are free slots, in groups of at most `prefill_tokens` tokens."""
        st, s, prompts, queue = self.st, self.s, self.prompts, self.queue
        device = st.lens.device
        while free and queue:
            width = len(
                prompts[queue[0]]
            )  # the queue is longest first: the group's first prompt is its longest
            take = min(len(free), len(queue), max(1, self.limits.prefill_tokens // width))
            group = [queue.popleft() for _ in range(take)]
            slots, free = free[:take], free[take:]
            ids = torch.full((take, width), s.stop_token_ids[0], dtype=torch.long)  # [n, P] left padded
            pos = torch.zeros((take, width), dtype=torch.long)
            offsets = torch.tensor([width - len(prompts[i]) for i in group], dtype=torch.long)
            for j, i in enumerate(group):
                ids[j, offsets[j] :] = torch.tensor(prompts[i], dtype=torch.long)
                pos[j, offsets[j] :] = torch.arange(len(prompts[i]))
            cols = torch.arange(width, device=device)
            valid = cols[None, :] >= offsets.to(device)[:, None]  # [n, P] real tokens
            mask = (cols[None, :, None] >= cols[None, None, :]) & valid[:, None, :]  # [n, P(q), P(k)] causal
            mask |= (
                cols[None, :, None] == cols[None, None, :]
            )  # a padding query sees itself (no empty row, no NaN)
            rows = torch.tensor(slots, dtype=torch.long, device=device)
            self.cache.prefill(rows, offsets.to(device), width)
            logits = (
                self.model(
                    input_ids=ids.to(device),
                    attention_mask=mask[:, None],
                    position_ids=pos.to(device),
                    past_key_values=self.cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
                .logits[:, -1, :]
                .float()
            )  # [n, V]
            lens = torch.tensor([len(prompts[i]) for i in group], dtype=torch.long)
            u = torch.stack(
                [request_uniforms(self.seeds[i], s.max_new_tokens) for i in group]
            )  # [n, max_new]
            st.lens[rows], st.ngen[rows], st.u[rows] = lens.to(device), 0, u.to(device)
            st.active[rows] = True
            if st.seen is not None:  # the prompt's tokens (a padding column repeats its row's first token)
                first = ids.gather(1, offsets[:, None])  # [n, 1]
                st.seen[rows] = False
                st.seen[rows[:, None].expand(-1, width), torch.where(valid.cpu(), ids, first).to(device)] = (
                    True
                )
            for j, b in enumerate(slots):
                st.req[b], st.host_lens[b] = group[j], int(lens[j])
            tok = next_tokens(logits, st.u[rows, 0], s, None if st.seen is None else st.seen[rows])
            self.record(rows, tok)

    def record(self, rows: torch.Tensor, tok: torch.Tensor) -> None:
        """Append `tok` ([m]) to the running rows `rows` ([m]); finished rows give their reply and free their slot."""
        st, s = self.st, self.s
        live = st.active[rows]
        st.out[rows, st.ngen[rows]] = tok
        st.last[rows] = tok
        st.ngen[rows] += live.long()
        if st.seen is not None:
            st.seen[rows, tok] = True
        done = live & (torch.isin(tok, self.stops) | (st.ngen[rows] >= s.max_new_tokens))
        finished = rows[done]
        if finished.numel() == 0:
            return
        ngen = st.ngen[finished].tolist()
        out = st.out[finished, : max(ngen)].tolist()
        for b, k, ids in zip(finished.tolist(), ngen, out, strict=True):
            self.replies[st.req[b]] = split_reply(ids[:k], s.stop_token_ids, s.max_new_tokens)
            st.req[b], st.host_lens[b] = -1, 0
        st.active[finished] = False
        st.lens[finished] = 0
        st.ngen[finished] = 0

    def step(self) -> None:
        """Decode one token for slots 0..n-1: feed each row's last token at position lens[b], written at column
        lens[b]."""
        st, s, cache = self.st, self.s, self.cache
        n = st.n
        longest = max(st.host_lens[:n]) + 1
        window = min(cache.capacity, -(-longest // WINDOW_STEP) * WINDOW_STEP)
        lens = st.lens[:n]

        def forward() -> torch.Tensor:
            mask = (self.columns[None, :window] <= lens[:, None])[:, None, None, :]  # [n, 1, 1, window]
            cache.decode(n, lens, window)
            out = self.model(
                input_ids=st.last[:n, None],
                attention_mask=mask,
                position_ids=lens[:, None],
                past_key_values=cache,
                use_cache=True,
            )
            return out.logits[:, -1, :].float()  # [n, V]

        logits = self.graphs.logits(forward, window) if self.graphs is not None and n == st.B else None
        if logits is None:
            logits = forward()
        rows = torch.arange(n, device=lens.device)
        u = st.u[:n].gather(1, st.ngen[:n, None].clamp(max=s.max_new_tokens - 1)).squeeze(1)
        tok = next_tokens(logits, u, s, None if st.seen is None else st.seen[:n])
        st.lens[:n] += st.active[:n].long()
        for b in range(n):
            if st.req[b] >= 0:
                st.host_lens[b] += 1
        self.record(rows, tok)


def _compact(st: _Slots, cache: SlotCache) -> None:
    """Move the running rows to slots 0..m-1 and run only those from now on."""
    keep_list = [b for b in range(st.n) if st.req[b] >= 0]
    keep = torch.tensor(keep_list, dtype=torch.long, device=st.lens.device)
    cache.compact(keep)
    tensors = [st.lens, st.ngen, st.last, st.active, st.out, st.u] + (
        [st.seen] if st.seen is not None else []
    )
    for t in tensors:
        t[: len(keep_list)] = t[keep]
    st.req = [st.req[b] for b in keep_list] + [-1] * (st.B - len(keep_list))
    st.host_lens = [st.host_lens[b] for b in keep_list] + [0] * (st.B - len(keep_list))
    st.n = len(keep_list)
