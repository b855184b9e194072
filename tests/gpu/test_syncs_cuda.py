"""The loss's per-depth counts make no host sync; rows copied one step ahead on a side stream
arrive equal to the host rows."""

from __future__ import annotations

import torch

from peagle_pipeline.core import loss
from peagle_pipeline.stages.train.loader import Cursor, ahead_to_device
from peagle_pipeline.stages.train.packed_batch import PackedBatch


def test_depth_counts_make_no_host_sync():
    g = torch.Generator().manual_seed(0)
    depth = torch.randint(0, 6, (500,), generator=g).cuda()
    valid, correct = (torch.rand(500, generator=g) > 0.3).cuda(), (torch.rand(500, generator=g) > 0.5).cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = loss._summarise(torch.tensor(1.0, device="cuda"), correct, valid, ~valid, depth, 4)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    d = depth.clamp(0, 3)
    assert torch.equal(out.total, torch.bincount(d[valid], minlength=4)[:4])


def _row(i: int) -> PackedBatch:
    g = torch.Generator().manual_seed(i)
    return PackedBatch(
        input_ids=torch.randint(0, 100, (64,), generator=g),
        aux_hidden=torch.randn(64, 96, generator=g).to(torch.bfloat16),
        topk_ids=torch.randint(0, 100, (64, 8), generator=g),
        topk_logprobs=torch.randn(64, 8, generator=g),
        weight=torch.rand(64, generator=g) > 0.5,
        last_hidden=None,
        doc_lengths=[64],
        sample_ids=[i],
        epoch=0,
        row=i,
    )


def test_rows_copied_ahead_arrive_equal():
    rows = [_row(i).pin_memory() for i in range(5)]

    def stream():
        for i, r in enumerate(rows):
            yield Cursor(0, i + 1), [r]

    got = list(zip(range(4), ahead_to_device(stream(), torch.device("cuda")), strict=False))
    for i, (cursor, (moved,)) in got:
        assert cursor == Cursor(0, i + 1) and moved.aux_hidden.is_cuda and not moved.weight.is_cuda
        assert torch.equal(moved.aux_hidden.cpu(), rows[i].aux_hidden)
        assert torch.equal(moved.topk_logprobs.cpu(), rows[i].topk_logprobs)
