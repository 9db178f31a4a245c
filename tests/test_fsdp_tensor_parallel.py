"""FSDP2 over tensor-parallel ranks (``gpus = dp x tp``, ``strategy="zero2"|"zero3"``): one
rank's estimate against real gloo ranks on a 2-D mesh (dp_shard x tp), and the layouts
refused before any profiling or rank."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from models import assert_model_unchanged, hf_llama, hf_tokens, snapshot_model

from vram_widget import measure, profile_model

pytestmark = pytest.mark.timeout(300)
pytest.importorskip("transformers")


def test_layouts_refused_before_any_profile_or_rank() -> None:
    import time

    import torch.distributed as dist

    torch.manual_seed(0)
    model, inputs = hf_llama(), hf_tokens(2)
    profile = profile_model(model, inputs=inputs, device="cpu")
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"tp=4 with gpus=6: .* tp must divide it"):
        profile.estimate(2, gpus=6, tp=4, strategy="zero3")
    # torchtitan's DDP refuses a mesh of more than one dimension; the reason says so
    for strategy in ("ddp", "zero1"):
        match = rf"tp=2 on gpus=4 with strategy='{strategy}': 2 data-parallel ranks.* 'hsdp'"
        with pytest.raises(ValueError, match=match + r".*more than one dimension"):
            profile.estimate(2, gpus=4, tp=2, strategy=strategy)
        with pytest.raises(ValueError, match=match):
            measure(model, inputs, gpus=4, tp=2, strategy=strategy)
    # hsdp with a node that splits a tp group, or gpus not whole nodes
    within = r"gpus_per_node=3: hsdp shards within a node"
    with pytest.raises(ValueError, match=within):
        profile.estimate(2, gpus=6, tp=2, strategy="hsdp", gpus_per_node=3)
    with pytest.raises(ValueError, match=within):
        measure(model, inputs, gpus=6, tp=2, strategy="hsdp", gpus_per_node=3)
    with pytest.raises(ValueError, match=r"gpus must be a whole number of nodes"):
        profile.estimate(2, gpus=6, tp=2, strategy="hsdp", gpus_per_node=4)
    with pytest.raises(ValueError, match=r"no data-parallel ranks to shard over"):
        measure(model, inputs, gpus=2, tp=2, strategy="zero3")
    with pytest.raises(ValueError, match=r"lora_rank with tp=2 on gpus=4: LoRA with FSDP2"):
        profile.estimate(2, gpus=4, tp=2, strategy="zero3", lora_rank=4)
    with pytest.raises(ValueError, match=r"loss_chunks with tp=2 on gpus=4"):
        measure(model, inputs, gpus=4, tp=2, strategy="zero3", loss_chunks=2)
    # a plan of torch styles with checkpointing (measured 11-14 % above on torchtitan's Llama)
    from torch.distributed.tensor.parallel import ColwiseParallel

    own = {"model.layers.0.mlp.up_proj": ColwiseParallel()}
    for gpus, strategy in ((2, "ddp"), (4, "zero3")):
        with pytest.raises(ValueError, match=r"tp=2 with tp_plan and checkpoint: not estimated"):
            profile.estimate(2, gpus=gpus, tp=2, strategy=strategy, tp_plan=own, checkpoint="auto")
    assert time.monotonic() - t0 < 10  # nothing profiled, no rank started
    assert not dist.is_initialized()
    # plan_layouts lists them as refused, with the estimate's reason
    plan = profile.plan_layouts("1 GiB", gpus=4, batch_size=4, strategies=["ddp", "zero1"])
    refused = {row.label: row.reason for row in plan.refused}
    for strategy in ("ddp", "zero1"):
        assert "more than one dimension" in refused[f"dp=2 {strategy} x tp=2"]


def test_a_rank_holds_the_dp_shard_of_its_tp_shard(one_thread: None) -> None:
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 66), nn.ReLU(), nn.Linear(66, 32))
    x = torch.randn(4, 32)
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    # zero2: one unit (the root) holds every parameter, which zero3 would warn of
    kwargs = {"optimizer": "adamw", "gpus": 4, "tp": 2, "tp_plan": plan, "strategy": "zero2"}
    est = profile_model(model, inputs=x, device="cpu").estimate(4, **kwargs)
    # tp=2, then FSDP2's dim-0 chunks over dp_shard=2 of each local tensor, rank 0's padded:
    # 0.weight 66 x 32 -> colwise 33 x 32 -> ceil(33 / 2) = 17 rows: 17 x 32 = 544
    # 0.bias   66      -> 33             -> 17
    # 2.weight 32 x 66 -> rowwise 32 x 33 -> 16 x 33 = 528
    # 2.bias   32      -> replicated 32   -> 16
    # (544 + 17 + 528 + 16) x 4 B = 1,105 x 4 = 4,420 B, as its gradients
    assert est.parameter_bytes == 4_420
    assert est.gradient_bytes == 4_420
    # AdamW: exp_avg and exp_avg_sq of each shard (2 x 4,420) and a 4-byte step per
    # parameter (4 x 4): 8,856 B
    assert est.optimizer_state_bytes == 8_856
    assert (est.gpus, est.tp, est.strategy, est.rank) == (4, 2, "zero2", 0)
    real = measure(model, x, timeout_s=60, **kwargs)
    assert (real.gpus, real.tp, real.strategy, len(real.rank_peak_bytes)) == (4, 2, "zero2", 4)
    # ranks 0 and 1 (dp rank 0) to the byte: the peak the root's reduce-scatter, the loss's
    # gradient seed held through it
    assert real.rank_peak_bytes[:2] == (est.peak_bytes,) * 2
    # rank 0 (dp rank 0: the padded, never short chunks) is the worst
    assert real.rank_peak_bytes[0] == max(real.rank_peak_bytes)
    # ranks 2 and 3 are dp rank 1 (tp the mesh's inner dimension): its chunks are short
    # (16 rows of 0.weight's 33) but FSDP2 keeps every shard padded to rank 0's size, so
    # its parameter bytes are the same
    for rank in (2, 3):
        other = profile_model(model, inputs=x, device="cpu").estimate(4, rank=rank, **kwargs)
        assert (other.rank, other.parameter_bytes) == (rank, 4_420)
        assert real.rank_peak_bytes[rank] == other.peak_bytes
    with pytest.raises(ValueError, match=r"rank must be None .* in \[0, 4\) for gpus=4"):
        profile_model(model, inputs=x, device="cpu").estimate(4, rank=4, **kwargs)


@pytest.mark.parametrize(
    ("precision", "strategy"),
    [("fp32", "zero3"), ("bf16", "zero3"), ("fp32", "zero2")],
)
def test_llama_ranks_against_real_fsdp_over_tp_ranks(
    one_thread: None, precision: str, strategy: str
) -> None:
    # transformers' own plan on the tp sub-mesh, then fully_shard on each decoder layer and
    # the root on the dp_shard sub-mesh, on 4 real gloo ranks; AdamW
    torch.manual_seed(0)
    model, inputs = hf_llama(), hf_tokens(2)
    before = snapshot_model(model)
    kwargs = {
        "precision": precision,
        "optimizer": "adamw",
        "gpus": 4,
        "tp": 2,
        "strategy": strategy,
    }
    profile = profile_model(model, inputs=inputs, device="cpu")
    # the root (embedding, lm_head, final norm) holds 63% of the parameters: zero3 says so
    said = pytest.warns(UserWarning, match=r"the root .* holds 63% of the parameters")
    with said if strategy == "zero3" else contextlib.nullcontext():
        est = profile.estimate(2, **kwargs)
    alone = profile.estimate(2, precision=precision, optimizer="adamw", gpus=2, tp=2)
    # FSDP2 halves the tp rank's parameters (each dim 0 here is even), gradients and state
    assert est.parameter_bytes * 2 == alone.parameter_bytes
    assert est.peak_bytes < alone.peak_bytes
    real = measure(model, inputs, timeout_s=120, **kwargs)
    assert_model_unchanged(model, before)
    assert (real.gpus, real.tp, real.strategy) == (4, 2, strategy)
    assert real.rank_peak_bytes == (est.peak_bytes,) * 4


@pytest.mark.parametrize(
    "levers",
    [
        {"mode": "inference", "optimizer": None},
        {"trainable": ["lm_head.*"]},
        {"grad_accumulation": 2},
        # fp32 at batch 2 the peak is the root's post-backward: FSDP2 redistributes the
        # embedding's replicated 1,000 x 64 gradient (256,000 B) to the weight's Shard(0),
        # a 500 x 64 clone (128,000 B), before it reshards, with layer 0's reduce-scatter
        # input (2 x 9,280 x 4 = 74,240 B) and the loss's gradient seed still held
        {"checkpoint": "auto"},
    ],
    ids=["inference", "frozen", "accumulation", "checkpoint"],
)
def test_llama_levers_against_real_fsdp_over_tp_ranks(
    one_thread: None, levers: dict[str, object]
) -> None:
    # inference is not wrapped (each tp group holds its shards); a frozen subset's units
    # never reduce-scatter; each micro-batch gathers and reduce-scatters again
    torch.manual_seed(0)
    model, inputs = hf_llama(), hf_tokens(2)
    kwargs = {"optimizer": "adamw", "gpus": 4, "tp": 2, "strategy": "zero3", **levers}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"zero3: the root", UserWarning)
        est = profile_model(model, inputs=inputs, device="cpu").estimate(2, **kwargs)
    real = measure(model, inputs, timeout_s=120, **kwargs)
    assert real.rank_peak_bytes == (est.peak_bytes,) * 4
    if "checkpoint" in levers:
        assert (est.peak_phase, est.peak_module) == ("backward", "model.embed_tokens")


def test_a_tensor_parallel_gradient_is_redistributed_before_the_reshard() -> None:
    from vram_widget._estimating.fsdp_post_backward import redistributed_grads
    from vram_widget._estimating.sharding import FsdpParam, _Inserts

    # the embedding's weight, tp-local 500 x 64 fp32, whose gradient came back replicated
    # (1,000 x 64 x 4 = 256,000 B), and a norm's weight (64 x 4 = 256 B) whose gradient
    # is its own size: only the first is redistributed, to 500 x 64 x 4 = 128,000 B
    params = [
        FsdpParam("embed.weight", (500, 64), 4, row=1, unit=0, trainable=True),
        FsdpParam("norm.weight", (64,), 4, row=2, unit=0, trainable=True),
    ]
    grads = [(7, 256_000, 1, 40), (9, 256, 2, 41)]
    ins = _Inserts()
    local = redistributed_grads(params, grads, ins, at=50)
    assert local == [(-1, 128_000, 1, 50), (9, 256, 2, 41)]
    # the clone first, then the old gradient's free (unsharded_param.grad = None)
    assert [(c[0], c[1], c[5]) for c in ins.cols] == [(50, 128_000, -1), (50, -256_000, 7)]


def test_the_gradient_seed_outlives_the_final_callback() -> None:
    from vram_widget._estimating.fsdp_post_backward import hold_seeds, release_seeds
    from vram_widget._estimating.options import Phase
    from vram_widget._estimating.sharding import _Inserts

    # a 4-byte seed (storage 5, row 3) freed at event 20 of the backward [10, 30): undone
    # right after its free (+4 before event 21), freed again after the inserts at 30 (here
    # one 8-byte temporary stands for the final callback); one freed at event 35, outside
    # this backward, is left alone
    ins = _Inserts()
    held = hold_seeds(ins, [(5, 4, 3, 20), (6, 4, 3, 35)], 10, 30)
    ins.temporary(30, 8, 0, Phase.BACKWARD)
    release_seeds(ins, held, 30)
    assert [(c[0], c[1], c[3]) for c in ins.cols] == [(21, 4, 3), (30, 8, 0), (30, -8, 0),
                                                      (30, -4, 3)]  # fmt: skip
    assert ins.cols[0][5] == ins.cols[-1][5] == 5


def test_llama_ranks_against_real_hsdp_over_tp_ranks(one_thread: None) -> None:
    # hsdp as torchtitan 0.3 composes it with tp: the ranks on a 3-D mesh (dp_replicate,
    # dp_shard, tp), transformers' plan on the tp sub-mesh, then fully_shard on each decoder
    # layer and the root over the 2-D (dp_replicate, dp_shard) sub-mesh; AdamW. 4 gloo ranks
    # of one node (gpus_per_node=8: a mesh of 1 x 2 x 2); 8 ranks on 2 nodes (2 x 2 x 2)
    # match to the byte as well, fp32 and bf16 (benchmarks/accuracy_parallel.py's grid)
    torch.manual_seed(0)
    model, inputs = hf_llama(), hf_tokens(2)
    kwargs = {"optimizer": "adamw", "gpus": 4, "tp": 2, "strategy": "hsdp"}
    profile = profile_model(model, inputs=inputs, device="cpu")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"hsdp: the root", UserWarning)
        est = profile.estimate(2, **kwargs)
        # ranks 0, 1 and 2, 3 are dp_shard ranks 0 and 1 (tp the inner dimension); the
        # tp ranks of a group hold the same bytes
        shards = [profile.estimate(2, rank=r, **kwargs) for r in (0, 2)]
    # one tp rank's parameters (64 hidden, 4 heads, 2 kv heads of 16, 128 intermediate,
    # 1,000 words, 2 layers): embed_tokens and lm_head 500 x 64 each = 64,000; a layer
    # q 32 x 64 + k, v 16 x 64 each + o 64 x 32 + gate, up 64 x 64 each + down 64 x 64
    # + two norms of 64 = 18,560, two = 37,120; the final norm 64: 101,184 elements.
    # dp_shard=2 halves each (every dim 0 even): 50,592 x 4 B = 202,368 B
    assert est.parameter_bytes == 202_368
    assert (est.gpus, est.tp, est.strategy) == (4, 2, "hsdp")
    real = measure(model, inputs, timeout_s=120, **kwargs)
    assert (real.gpus, real.tp, real.strategy, len(real.rank_peak_bytes)) == (4, 2, "hsdp", 4)
    assert real.rank_peak_bytes == tuple(shards[r // 2].peak_bytes for r in range(4))
    assert est.peak_bytes == max(real.rank_peak_bytes)


@pytest.mark.slow  # first pass only: the same kernels as the hsdp test above, in both
def test_llama_ranks_against_real_hsdp_over_tp_replicas(one_thread: None) -> None:
    # hsdp with one tp group a node (gpus_per_node == tp): torchtitan 0.3.0's layout for a
    # replicate degree alone, a mesh of 2 x 1 x 2 (dp_replicate, dp_shard, tp) and
    # fully_shard over the (dp_replicate, dp_shard) sub-mesh, a shard dimension of 1; AdamW.
    # bf16 matches to the byte too (benchmarks/accuracy_parallel.py's dp_shard=1 rows)
    torch.manual_seed(0)
    model, inputs = hf_llama(), hf_tokens(2)
    kwargs = {"optimizer": "adamw", "gpus": 4, "tp": 2, "strategy": "hsdp", "gpus_per_node": 2}
    profile = profile_model(model, inputs=inputs, device="cpu")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"hsdp: the root", UserWarning)
        est = profile.estimate(2, **kwargs)
    # a shard of one rank is the tp rank's whole local parameter, as tp alone holds it:
    # 101,184 elements (test_llama_ranks_against_real_hsdp_over_tp_ranks) x 4 B = 404,736 B
    assert est.parameter_bytes == 404_736
    alone = profile.estimate(2, optimizer="adamw", gpus=2, tp=2)
    assert est.parameter_bytes == alone.parameter_bytes
    real = measure(model, inputs, timeout_s=120, **kwargs)
    assert (real.gpus, real.tp, real.strategy) == (4, 2, "hsdp")
    # every rank holds the same bytes (the replicas and the tp ranks of a group alike)
    assert real.rank_peak_bytes == (est.peak_bytes,) * 4
