"""The training device of a process (stages/distributed.resolve_device): pure, so it runs without a GPU."""

import pytest
import torch

from peagle_pipeline.errors import BadConfig
from peagle_pipeline.stages.train.distributed import resolve_device


@pytest.mark.parametrize(
    ("device", "local", "world", "cuda", "expected"),
    [
        ("auto", 0, 1, False, "cpu"),
        ("auto", 0, 1, True, "cuda:0"),
        ("auto", 3, 4, True, "cuda:3"),
        (
            "cuda",
            0,
            1,
            True,
            "cuda:0",
        ),  # a bare "cuda" gets an index: torch.cuda.set_device refuses it (seen on H100)
        ("cuda", 2, 1, True, "cuda:0"),
        ("cuda", 2, 4, True, "cuda:2"),
        ("cuda:1", 0, 4, True, "cuda:1"),
        ("cpu", 1, 2, True, "cpu"),
    ],
)
def test_resolve_device(device, local, world, cuda, expected):
    dev = resolve_device(device, local, world, cuda)
    assert dev == torch.device(expected)
    if dev.type == "cuda":
        assert dev.index is not None


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_resolve_device_refuses_cuda_without_cuda(device):
    with pytest.raises(BadConfig, match="CUDA is not available"):
        resolve_device(device, 0, 1, False)
