"""vram_widget._profiling.recorder helpers with hand-checked answers."""

from __future__ import annotations

import pytest
import torch

from vram_widget._profiling.recorder import _non_overlapping_and_dense


@pytest.mark.parametrize(
    ("t", "dense"),
    [
        (torch.empty(3, 4), True),
        (torch.empty(3, 4).t(), True),  # a permutation of a contiguous tensor
        (torch.empty(2, 3, 8, 8).to(memory_format=torch.channels_last), True),
        (torch.empty(3, 1, 4)[:, :, :], True),  # size-1 dims do not count
        (torch.empty(4, 6)[:, :3], False),  # a slice leaves gaps
        (torch.empty(4).expand(3, 4), False),  # stride 0: overlapping
        (torch.empty(3, 4)[::2], False),
    ],
)
def test_non_overlapping_and_dense(t: torch.Tensor, dense: bool) -> None:
    assert _non_overlapping_and_dense(t) is dense
