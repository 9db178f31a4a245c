"""The batch x sequence-length frontier: the grid, the walk, and a profile's frontier against
its own estimates (every point fits, one more sample does not)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vram_widget import profile_model, zoo
from vram_widget._estimating.profile import ModelProfile
from vram_widget._estimating.tradeoff import Frontier, batch_seq_frontier, length_grid

MIB = 2**20


def test_length_grid_is_two_per_doubling_with_the_extras() -> None:
    # 2**(k/2) for k = 0..14, rounded: 1 1 2 3 4 6 8 11 16 23 32 45 64 91 128
    assert length_grid(128).tolist() == [1, 2, 3, 4, 6, 8, 11, 16, 23, 32, 45, 64, 91, 128]
    # up to 100: 2**(13/2) = 90.5 -> 91, then the limit; extras inside it join, 1000 does not
    grid = length_grid(100, extra=[50, 1000]).tolist()
    assert grid == [1, 2, 3, 4, 6, 8, 11, 16, 23, 32, 45, 50, 64, 91, 100]
    with pytest.raises(ValueError, match="limit must be >= 1"):
        length_grid(0)


def test_frontier_walk_stops_where_nothing_fits_and_skips_unanswerable_lengths() -> None:
    asked: list[int] = []

    def largest(length: int) -> int:
        # 9,000 bytes of room at 100 bytes per token: 9000 // (100 * length)
        asked.append(length)
        return 9_000 // (100 * length)

    f = batch_seq_frontier(largest, [10, 1, 50, 91, 200, 400], 10_000, lambda n: n != 50)
    assert f.seq_lens.tolist() == [1, 10, 91, 200, 400]  # 50 left out
    assert f.max_batch_sizes.tolist() == [90, 9, 0, 0, 0]  # 9000 // 9100 = 0 at 91
    assert asked == [1, 10, 91]  # nothing fits at 91, so longer lengths are not asked
    assert not f.complete
    assert f.tokens_per_step.tolist() == [90, 90, 0, 0, 0]
    assert f.max_batch_at(10) == 9 and f.max_batch_at(50) is None


@pytest.fixture(scope="module")
def tokens() -> ModelProfile:
    entry = zoo.ZOO["dict_input"]  # input_ids / attention_mask (B, 32): a sequence axis
    return profile_model(entry.build(), inputs=entry.make_inputs(2))


def test_every_frontier_point_fits_and_one_more_sample_does_not(tokens: ModelProfile) -> None:
    # 96 MiB of room beside the CUDA context (a capacity below the context is refused): the
    # training step's two 32 MiB cuBLAS workspaces (Hopper) and 32 MiB for the step
    capacity = tokens.estimate(1).extras.cuda_context_bytes + 96 * MIB
    f = tokens.frontier(capacity, optimizer="sgd")
    assert f.complete and f.capacity_bytes == capacity
    assert f.seq_lens[0] == 1 and 32 in f.seq_lens  # the example's length is on the grid
    assert f.seq_lens[-1] == 2**17  # no position table: up to 128k tokens
    # the largest batch never grows with the length; short lengths fit, the longest does not
    assert np.all(np.diff(f.max_batch_sizes) <= 0)
    assert f.max_batch_sizes[0] > 1000 and f.max_batch_sizes[-1] == 0
    for length, batch in zip(f.seq_lens.tolist(), f.max_batch_sizes.tolist(), strict=True):
        if batch == 0:
            assert not tokens.estimate(1, optimizer="sgd", seq_len=length).fits(capacity)
            continue
        assert tokens.estimate(batch, optimizer="sgd", seq_len=length).fits(capacity)
        above = tokens.estimate(batch + 1, optimizer="sgd", seq_len=length)
        assert not above.fits(capacity), length


def test_capacities_the_cuda_context_fills_are_refused(tokens: ModelProfile) -> None:
    # the context (accelerator.CUDA_CONTEXT_BYTES: 775 MiB on Hopper) leaves the allocator nothing
    context = tokens.estimate(1).extras.cuda_context_bytes
    for call in (
        lambda: tokens.max_batch_size(context),
        lambda: tokens.max_seq_len(64 * MIB, batch_size=2),
        lambda: tokens.frontier("256 MiB"),
    ):
        with pytest.raises(ValueError, match=r"not above the CUDA context alone \(812,646,400"):
            call()
    # beside it, the two workspaces of a training step (2 x 32 MiB) and room for the step
    assert tokens.max_batch_size(context + 96 * MIB) > 0


def test_frontier_at_chosen_lengths_and_settings(tokens: ModelProfile) -> None:
    f = tokens.frontier("1 GiB", "bf16", "adamw", "train", seq_lens=[32, 500, 7])
    assert f.seq_lens.tolist() == [7, 32, 500]
    for length in (7, 32, 500):
        expected = tokens.max_batch_size(2**30, "bf16", "adamw", seq_len=length)
        assert f.max_batch_at(length) == expected
    inference = tokens.frontier("1 GiB", "bf16", mode="inference", seq_lens=[500])
    assert inference.max_batch_at(500) > f.max_batch_at(500)  # no gradients or state


def test_frontier_refuses_a_profile_without_a_sequence() -> None:
    profile = profile_model(zoo.mlp(hidden=(8,)), input_size=(784,), device="cpu")
    with pytest.raises(ValueError, match="no sequence axis"):
        profile.frontier("1 GiB")


def test_frontier_leaves_out_lengths_that_need_a_run_each() -> None:
    # Padding to 48 is no polynomial the profile can verify: only the lengths profiled so
    # far are answered (the example's and the one the fit attempt profiled), and the
    # frontier says it is incomplete; profile_lengths=True profiles each.
    class PadsTo48(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(50, 16)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.pad(self.emb(ids), (0, 0, 0, -ids.shape[1] % 48))

    profile = profile_model(PadsTo48(), inputs=torch.zeros(2, 16, dtype=torch.long))
    partial = profile.frontier("1 GiB", optimizer="sgd", seq_lens=[1, 16, 40, 100])
    assert not partial.complete and partial.seq_lens.tolist() == [1, 16]
    full = profile.frontier(
        "1 GiB", optimizer="sgd", seq_lens=[1, 16, 40, 100], profile_lengths=True
    )
    assert full.complete and full.seq_lens.tolist() == [1, 16, 40, 100]
    assert full.max_batch_at(40) == profile.max_batch_size("1 GiB", optimizer="sgd", seq_len=40)


def test_frontier_dataclass_is_frozen() -> None:
    f = Frontier(1, np.array([1]), np.array([1]), complete=True)
    with pytest.raises(AttributeError):
        f.complete = False  # type: ignore[misc]
