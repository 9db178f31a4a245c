"""ModelProfile.plan_layouts: every dp x tp x pp layout of N GPUs the estimate answers, best
first, and the ones it refuses with their reasons."""

from __future__ import annotations

import pytest
import torch
from models import hf_llama, hf_tokens

from vram_widget import ModelProfile, profile_model, zoo
from vram_widget._estimating.layouts import LayoutPlan, divisors


@pytest.fixture(scope="module")
def mlp() -> ModelProfile:
    # 3 Linear(256, 256) layers: 3 x (65,536 + 256) = 197,376 fp32 parameters, 789,504 B
    model = zoo.mlp(256, hidden=(256, 256), num_classes=256, dropout=0.0)
    return profile_model(model, input_size=(256,), device="cpu")


def _plan(mlp: ModelProfile, capacity: int) -> LayoutPlan:
    # each Linear its own FSDP2 unit (a third of the parameters each)
    return mlp.plan_layouts(capacity, gpus=2, batch_size=8, fsdp_units=["Linear"])


def test_data_parallel_layouts_by_hand(mlp: ModelProfile) -> None:
    plan = _plan(mlp, 3 * 2**20)
    rows = {row.strategy.value: row for row in plan.layouts if row.strategy is not None}
    assert set(rows) == {"ddp", "zero1", "zero2", "zero3", "hsdp"}
    assert all(row.rank_batch_size == 4 for row in rows.values())  # 8 samples over 2 ranks
    # DDP keeps every parameter, and its buckets hold every gradient once more: 789,504 B
    assert rows["ddp"].estimate.parameter_bytes == 789_504
    assert rows["ddp"].communication_bytes == 789_504
    # ZeRO-3 keeps its dim-0 shard of each: 128 of 256 rows of each weight and bias,
    # 3 x (128 x 256 + 128) = 98,688 parameters, 394,752 B; no resident buckets
    for name in ("zero2", "zero3", "hsdp"):
        assert rows[name].estimate.parameter_bytes == 394_752, name
        assert rows[name].communication_bytes == 0
    # Adam's two moments of the shard, 2 x 394,752 B, and 6 float32 step counts: 789,528 B
    assert rows["zero3"].estimate.optimizer_state_bytes == 2 * 394_752 + 6 * 4
    # ZeRO-1's partition, largest first to the emptiest rank: rank 0 takes weights 1 and 3
    # (2 x 65,536), rank 1 weight 2 and the 3 biases; rank 0's Adam state is the worst:
    # 2 x 131,072 x 4 B + 2 step counts x 4 B = 1,048,584 B
    assert rows["zero1"].estimate.optimizer_state_bytes == 1_048_584
    # the ZeRO paper's count of copies of the parameters moved per step
    assert {k: r.traffic_params for k, r in rows.items()} == {
        "ddp": 2.0, "zero1": 3.0, "zero2": 2.0, "zero3": 3.0, "hsdp": 3.0,
    }  # fmt: skip
    # the same in bytes over 2 ranks, (k - 1) / k = 1/2 of those copies of 789,504 B
    # (every parameter trains: the gradients are as many bytes): 789,504 and 1,184,256 B
    assert {k: r.communication_sent_bytes for k, r in rows.items()} == {
        "ddp": 789_504, "zero1": 1_184_256, "zero2": 789_504, "zero3": 1_184_256,
        "hsdp": 1_184_256,
    }  # fmt: skip
    assert dict(rows["zero2"].communication_sent_bytes_by_kind) == {
        "all_gather": 394_752, "reduce_scatter": 394_752,
    }  # fmt: skip


def test_order_fits_first_then_traffic_then_bytes(mlp: ModelProfile) -> None:
    capacity = 3 * 2**20
    plan = _plan(mlp, capacity)
    for row in plan.layouts:  # on the CPU, fits is total_bytes <= capacity, no extras
        assert row.fit_bytes == row.estimate.total_bytes == row.peak_bytes
        assert row.fits == (row.fit_bytes <= capacity)
    # 3 MiB: the sharded layouts fit (ZeRO-2 moves 2 copies, ZeRO-3 and HSDP 3), DDP's and
    # ZeRO-1's whole parameters, gradients and buckets do not (2 copies before 3)
    assert [(row.label, row.fits) for row in plan.layouts] == [
        ("dp=2 zero2", True), ("dp=2 zero3", True), ("dp=2 hsdp", True),
        ("dp=2 ddp", False), ("dp=2 zero1", False),
    ]  # fmt: skip
    assert plan.best is plan.layouts[0]
    assert plan.layouts[0].fit_bytes > plan.layouts[1].fit_bytes  # traffic before bytes
    # the MLP has no tensor-parallel plan and is no decoder: refused, each with its reason
    refused = {row.label: row.reason for row in plan.refused}
    assert set(refused) == {"tp=2", "pp=2 gpipe m=2", "pp=2 1f1b m=2", "pp=2 interleaved-1f1b m=2"}
    assert "has no tensor-parallel plan" in refused["tp=2"]
    assert "splits a Hugging Face decoder" in refused["pp=2 gpipe m=2"]
    assert "splits a Hugging Face decoder" in refused["pp=2 interleaved-1f1b m=2"]
    # the same layout asked of estimate directly is the row's estimate
    direct = mlp.estimate(4, gpus=2, strategy="zero3", fsdp_units=["Linear"])
    assert plan.layouts[1].peak_bytes == direct.peak_bytes


def test_nothing_fits_and_one_gpu(mlp: ModelProfile) -> None:
    plan = _plan(mlp, 2**20)
    assert plan.best is None and plan.fitting == ()
    single = mlp.plan_layouts(2**30, gpus=1, batch_size=8)
    assert [row.label for row in single.layouts] == ["dp=1"] and single.refused == ()
    assert single.layouts[0].peak_bytes == mlp.estimate(8).peak_bytes
    assert single.layouts[0].traffic_params == 0.0
    assert single.layouts[0].communication_sent_bytes == 0


def test_a_batch_the_ranks_do_not_split_is_refused(mlp: ModelProfile) -> None:
    plan = mlp.plan_layouts(2**30, gpus=4, batch_size=6, strategies=["ddp"])
    refused = {row.label: row.reason for row in plan.refused}
    assert "batch_size=6 is not split evenly over dp=4" in refused["dp=4 ddp"]
    # 6 over 2 ranks is even: that layout is tried, and the estimate's own reason kept
    assert "with strategy='ddp': 2 data-parallel ranks" in refused["dp=2 ddp x tp=2"]
    assert plan.layouts == ()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gpus": 0}, r"gpus must be a whole number of GPUs >= 1, got 0"),
        ({"gpus": 2.0}, r"gpus must be a whole number of GPUs >= 1, got 2.0"),
        ({"gpus": 2, "batch_size": 0}, r"batch_size must be a whole number >= 1"),
        ({"gpus": 2, "strategy": "zero3"}, r"plan_layouts chooses the layout; strategy"),
        ({"gpus": 2, "tp": 2}, r"plan_layouts chooses the layout; tp"),
        ({"gpus": 2, "strategies": ["zero4"]}, r"strategies"),
        ({"gpus": 2, "strategies": []}, r"strategies is empty"),
    ],
)
def test_bad_input_is_refused(mlp: ModelProfile, kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        mlp.plan_layouts(2**30, **kwargs)  # type: ignore[arg-type]


def test_bad_capacities_are_refused(mlp: ModelProfile) -> None:
    with pytest.raises(ValueError, match=r"1 MiB"):
        mlp.plan_layouts(80, gpus=2)
    with pytest.raises(ValueError, match=r"GPU"):
        mlp.plan_layouts("no such card", gpus=2)


def test_divisors() -> None:
    assert divisors(1) == [1]
    assert divisors(8) == [1, 2, 4, 8]
    assert divisors(7) == [1, 7]


@pytest.mark.timeout(300)
def test_llama_has_tensor_and_pipeline_rows() -> None:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    profile = profile_model(hf_llama(), inputs=hf_tokens(2), device="cpu")
    plan = profile.plan_layouts("64 MiB", gpus=2, batch_size=4, optimizer="adamw")
    rows = {row.label: row for row in plan.layouts}
    assert set(rows) == {
        "dp=2 ddp", "dp=2 zero1", "dp=2 zero2", "dp=2 zero3", "dp=2 hsdp",
        "tp=2", "pp=2 gpipe m=2", "pp=2 1f1b m=2", "pp=2 interleaved-1f1b m=2",
    }  # fmt: skip
    # one tensor-parallel rank: the 806,912 B of Linear and embedding weights halved,
    # the 5 RMSNorm weights of 64 fp32 (1,280 B) whole: 403,456 + 1,280
    assert rows["tp=2"].estimate.parameter_bytes == 403_456 + 1_280
    assert rows["tp=2"].rank_batch_size == 4  # every tensor-parallel rank sees the batch
    # the worst pipeline stage decides: the last (norm, lm_head and the loss)
    gpipe = rows["pp=2 gpipe m=2"]
    assert gpipe.peak_bytes == max(gpipe.estimate.stage_peak_bytes)
    assert gpipe.peak_bytes == gpipe.estimate.stage_peak_bytes[1]
    for label in ("tp=2", "pp=2 gpipe m=2", "pp=2 1f1b m=2"):
        assert rows[label].traffic_params is None and rows[label].communication_bytes is None
    # the bytes a rank sends per step (fp32, batch 4 x 16 tokens, hidden 64):
    # a pipeline stage sends 2 micro-batches' hidden states (or their gradients),
    # 2 x (2 x 16 x 64 x 4 B) = 16,384 B; the tensor-parallel rank 16 all-reduces of a
    # hidden state, 16 x 2 x 1/2 x 16,384 B = 262,144 B, and the logits gathered once,
    # 1/2 x 4 x 16 x 1,000 x 4 B = 128,000 B (tests/test_communication.py checks both
    # against gloo); DDP all-reduces the 808,192 B of gradients: 2 x 1/2 x 808,192 B
    sent = {label: row.communication_sent_bytes for label, row in rows.items()}
    assert sent["pp=2 gpipe m=2"] == sent["pp=2 1f1b m=2"] == 16_384
    assert sent["tp=2"] == 262_144 + 128_000
    assert sent["dp=2 ddp"] == 808_192
    # zero2: 1/2 x (808,192 + 808,192); zero1, zero3 and hsdp (2 ranks, one node): 3/2 x
    assert sent["dp=2 zero2"] == 808_192
    assert sent["dp=2 zero1"] == sent["dp=2 zero3"] == sent["dp=2 hsdp"] == 1_212_288
    # all fit 64 MiB: the fewest bytes sent first, the pipelines, then tensor parallel,
    # then the data-parallel layouts
    assert all(row.fits for row in plan.layouts)
    order = [row.label for row in plan.layouts]
    assert order.index("pp=2 1f1b m=2") < order.index("tp=2") < order.index("dp=2 ddp")
    assert order.index("dp=2 ddp") < order.index("dp=2 zero1")
    assert plan.refused == ()
    # ScheduleInterleaved1F1B's two stages a rank: rank r holds stages r and r + 2
    interleaved = rows["pp=2 interleaved-1f1b m=2"].estimate
    assert (interleaved.pp_schedule, interleaved.stages_per_rank) == ("interleaved-1f1b", 2)
    # stages 0 -> 1 -> 2 -> 3 over ranks 0, 1, 0, 1: rank 0 sends stage 0's and stage 2's
    # outputs forward and stage 2's input gradient back, 3 x 2 micro-batches x 8,192 B
    assert sent["pp=2 interleaved-1f1b m=2"] == 3 * 2 * 8_192
    assert order.index("pp=2 1f1b m=2") < order.index("pp=2 interleaved-1f1b m=2")
    assert order.index("pp=2 interleaved-1f1b m=2") < order.index("tp=2")
    assert "zero3: the root" in rows["dp=2 zero3"].warnings[0]  # kept, not issued


def test_fsdp_gathers_autocast_copies(mlp: ModelProfile) -> None:
    plan = mlp.plan_layouts(
        2**30, gpus=2, batch_size=8, precision="amp-bf16", strategies=["zero2", "ddp"]
    )
    rows = {row.strategy.value: row for row in plan.layouts if row.strategy is not None}
    # amp-bf16 keeps fp32 weights and gradients, 789,504 B each; FSDP2's
    # MixedPrecisionPolicy gathers bf16 copies, 394,752 B: zero2 sends 1/2 of them and
    # 1/2 of the fp32 gradients reduce-scattered, 197,376 + 394,752 = 592,128 B; ddp
    # all-reduces the fp32 gradients, 2 x 1/2 x 789,504 B
    assert rows["zero2"].communication_sent_bytes == 592_128
    assert rows["ddp"].communication_sent_bytes == 789_504
    assert [row.label for row in plan.layouts] == ["dp=2 zero2", "dp=2 ddp"]


@pytest.mark.timeout(300)
def test_llama_has_fsdp_over_tensor_parallel_rows() -> None:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    profile = profile_model(hf_llama(), inputs=hf_tokens(2), device="cpu")
    plan = profile.plan_layouts(
        "64 MiB", gpus=4, batch_size=4, optimizer="adamw", strategies=["ddp", "zero3"]
    )
    rows = {row.label: row for row in plan.layouts}
    refused = {row.label: row.reason for row in plan.refused}
    assert "FSDP2 over the tensor-parallel ranks" in refused["dp=2 ddp x tp=2"]
    row = rows["dp=2 zero3 x tp=2"]
    # each of the 2 tensor-parallel groups takes half the batch; the row is estimate's
    assert row.rank_batch_size == 2
    direct = profile.estimate(2, optimizer="adamw", gpus=4, tp=2, strategy="zero3")
    assert row.peak_bytes == direct.peak_bytes
    # zero3's 3 copies, over the rank's own tp shard: 1 / 2 of the parameters
    assert row.traffic_params == 3.0 / 2
    assert row.communication_bytes is None
    # sent: the tp rank's recorded collectives plus zero3's over the rank's tp shard of the
    # parameters and gradients (1 / tp of the model's): 3 x 1/2 x (whole / 2)
    whole = profile.estimate(4, optimizer="adamw")
    tp_alone = profile.estimate(2, optimizer="adamw", gpus=2, tp=2)
    assert tp_alone.communication_sent_bytes is not None
    shard = whole.parameter_bytes // 2
    assert row.communication_sent_bytes == tp_alone.communication_sent_bytes + 3 * shard // 2
    # tensor-parallel pipeline stages (pp x tp = 4), every schedule answered: the whole
    # batch through the pipeline, the row the estimate's
    assert {"tp=2 x pp=2 gpipe m=2", "tp=2 x pp=2 interleaved-1f1b m=2"} <= set(rows)
    staged = rows["tp=2 x pp=2 1f1b m=2"]
    assert staged.rank_batch_size == 4
    direct = profile.estimate(
        4, optimizer="adamw", gpus=4, tp=2, pp=2, pp_schedule="1f1b", microbatches=2
    )
    assert staged.peak_bytes == direct.peak_bytes
