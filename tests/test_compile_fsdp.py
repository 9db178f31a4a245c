"""``torch.compile`` per block under FSDP2, as torchtitan composes them: each repeated
block compiled (``Module.compile(fullgraph=True)``), then ``fully_shard`` on each block and
the root, on real gloo ranks (``measure``), and the per-rank estimate against them.

FSDP2's hooks on a compiled block are not traced (``_dynamo_disable``): dynamo skips the
block's ``_call_impl`` frame and compiles its ``forward`` whole, the all-gathers and
reduce-scatters running eagerly around it. So a rank's step is the single-device compiled
step (Inductor's saved set and buffer plan per block) with FSDP2's shards, gathers and
reduce-scatters at the block boundaries, as for the eager step.

Each rank-running test forks its ranks (gloo on 127.0.0.1), bounded in time; every process
is stopped by its PID (``distributed.run_ranks``).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from models import assert_model_unchanged, hf_llama, hf_tokens, snapshot_model
from torch import nn

from vram_widget import measure, profile_model, zoo
from vram_widget._estimating.compiled import CompileScope, check_compile_parallel
from vram_widget._estimating.options import Precision, Strategy
from vram_widget._estimating.sharding import Parallel

pytestmark = pytest.mark.timeout(600)


class Block(nn.Module):
    """``x + b(sin(a(x)))`` at width 16 (hidden 32): a block of its own class, outside
    torch.nn, so dynamo compiles its forward under FSDP2."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.sin(self.a(x)))


class Stack(nn.Module):
    """An input Linear, two ``Block``s in a ModuleList, an output Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _batch() -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(0))


def test_whole_model_and_other_strategies_are_refused() -> None:
    zero3 = Parallel(2, Strategy.ZERO3)
    check_compile_parallel(CompileScope.BLOCKS, zero3, precision=Precision.BF16)  # estimated
    check_compile_parallel(CompileScope.MODEL, Parallel(1, Strategy.ZERO3))  # one device
    with pytest.raises(ValueError, match=r"torchtitan compiles each block before fully_shard"):
        check_compile_parallel(CompileScope.MODEL, zero3)
    for strategy in (Strategy.DDP, Strategy.ZERO1):
        with pytest.raises(ValueError, match=r"with FSDP2 \(strategy='zero2', 'zero3'"):
            check_compile_parallel(CompileScope.BLOCKS, Parallel(2, strategy))
    with pytest.raises(ValueError, match=r"and checkpoint, precision='amp-bf16': not"):
        check_compile_parallel(
            CompileScope.BLOCKS, zero3, precision=Precision.AMP_BF16, levers={"checkpoint": True}
        )
    units = Parallel(2, Strategy.ZERO2, fsdp_units=("blocks.0",))
    with pytest.raises(ValueError, match=r"strategy='zero2' and fsdp_units: not estimated"):
        check_compile_parallel(CompileScope.BLOCKS, units)


def test_refusals_come_before_profiling_and_before_any_rank() -> None:
    model, batch = Stack(), _batch()
    profile = profile_model(model, inputs=batch, device="cpu", cache=False)
    assert profile.compile_fsdp_refusal == ""  # Block's forward is compiled under FSDP2
    with pytest.raises(ValueError, match=r"compile='model' with strategy='zero3': torchtitan"):
        profile.estimate(4, "fp32", "adamw", gpus=2, strategy="zero3", compile=True)
    with pytest.raises(ValueError, match=r"precision='amp-bf16': not estimated"):
        profile.estimate(4, "amp-bf16", "adamw", gpus=2, strategy="zero3", compile="blocks")
    with pytest.raises(ValueError, match=r"and grad_accumulation: not estimated"):
        profile.estimate(
            4, "fp32", "adamw", gpus=2, strategy="zero3", compile="blocks", grad_accumulation=2
        )
    # measure refuses alike, before any rank starts (a rank would fail only after a fork)
    with pytest.raises(ValueError, match=r"compile='model' with strategy='zero2': torchtitan"):
        measure(model, batch, gpus=2, strategy="zero2", compile=True)
    with pytest.raises(ValueError, match=r"and checkpoint: not estimated"):
        measure(model, batch, gpus=2, strategy="zero3", compile="blocks", checkpoint="auto")
    with pytest.raises(ValueError, match=r"tp > 1"):
        measure(model, batch, gpus=2, tp=2, compile="blocks")


def test_torch_nn_blocks_are_refused_under_fsdp2() -> None:
    # nn.TransformerEncoderLayer's forward is in dynamo's skip list once fully_shard has
    # swapped its class for FSDPTransformerEncoderLayer: fullgraph=True compiles nothing
    model = zoo.transformer_encoder()
    tokens = torch.randint(0, 1000, (2, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"TransformerEncoderLayer's forward is torch's own"):
        measure(model, tokens, gpus=2, strategy="zero3", compile="blocks")
    profile = profile_model(model, inputs=tokens, device="cpu", cache=False)
    assert "FSDPTransformerEncoderLayer is not" in profile.compile_fsdp_refusal
    with pytest.raises(ValueError, match=r"strategy='zero3': each TransformerEncoderLayer"):
        profile.estimate(2, "fp32", "adamw", gpus=2, strategy="zero3", compile="blocks")


@pytest.mark.slow
def test_compiled_blocks_zero2_ranks_are_their_estimate(one_thread: None) -> None:
    # zero2 over two gloo ranks, each block compiled then fully_shard'ed: every rank's
    # measured peak is its estimate to the byte (about 2 min on 2 busy cores: Inductor
    # compiles in the profile and in each rank)
    model, batch = Stack(), _batch()
    before = snapshot_model(model)
    profile = profile_model(model, inputs=batch, device="cpu", cache=False)
    real = measure(model, batch, optimizer="adamw", gpus=2, strategy="zero2", compile="blocks")
    assert (real.compile, real.strategy, len(real.rank_peak_bytes)) == (
        CompileScope.BLOCKS, "zero2", 2,
    )  # fmt: skip
    for rank, peak in enumerate(real.rank_peak_bytes):
        settings = {"gpus": 2, "strategy": "zero2", "rank": rank}
        est = profile.estimate(4, "fp32", "adamw", compile="blocks", **settings)
        assert est.peak_bytes == peak, (rank, est.peak_bytes, peak)
        assert not est.compile_bound
    assert_model_unchanged(model, before)
    assert all(block._compiled_call_impl is None for block in model.blocks)


@pytest.mark.slow
def test_compiled_blocks_zero3_ranks_match_as_the_eager_ranks(one_thread: None) -> None:
    # zero3: the peak is at the last block's reduce-scatter, where the unit's last
    # gradient (b.bias, 16 x 4 B) is still bound to foreach_reduce's loop variable; the
    # compiled backward gives it to the block's row, where the estimate finds it. Both
    # estimates match their ranks to the byte, the 8 B and 4 B gloo allocates inside the
    # reduce-scatter to average it (sharding.gloo_average_bytes) included
    model, batch = Stack(), _batch()
    profile = profile_model(model, inputs=batch, device="cpu", cache=False)
    compiled = measure(model, batch, optimizer="adamw", gpus=2, strategy="zero3", compile="blocks")
    eager = measure(model, batch, optimizer="adamw", gpus=2, strategy="zero3")
    for rank in range(2):
        settings = {"gpus": 2, "strategy": "zero3", "rank": rank}
        est = profile.estimate(4, "fp32", "adamw", compile="blocks", **settings)
        eager_est = profile.estimate(4, "fp32", "adamw", **settings)
        gap = compiled.rank_peak_bytes[rank] - est.peak_bytes
        assert gap == eager.rank_peak_bytes[rank] - eager_est.peak_bytes, rank
        assert gap == 0, rank


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_llama_compiled_blocks_zero3_ranks_are_their_estimate(
    one_thread: None, precision: str
) -> None:
    # the tiny Hugging Face Llama (2 layers of 64), batch 4 x 16 tokens, AdamW: each
    # LlamaDecoderLayer compiled, then fully_shard per layer and on the root; measured
    # per rank (fp32 3,378,204 B, bf16 2,083,516 B on each rank) and estimated the same
    model, batch = hf_llama(), hf_tokens(4)
    real = measure(
        model, batch, optimizer="adamw", precision=precision, gpus=2, strategy="zero3",
        compile="blocks",
    )  # fmt: skip
    profile = profile_model(model, inputs=batch, device="cpu", cache=False)
    for rank, peak in enumerate(real.rank_peak_bytes):
        with warnings.catch_warnings():  # the root (embeddings and head) holds 63 %
            warnings.filterwarnings("ignore", message="zero3: the root", category=UserWarning)
            est = profile.estimate(
                4, precision, "adamw", gpus=2, strategy="zero3", compile="blocks", rank=rank
            )
        assert est.peak_bytes == peak, (rank, est.peak_bytes, peak)
