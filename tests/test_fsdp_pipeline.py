"""FSDP2 over pipeline stages (``gpus = dp x pp``, ``strategy="zero2"|"zero3"``): each
stage's step on fake tensors with ``fully_shard`` over the stage's data-parallel ranks,
against 4 real gloo ranks running torch's ``PipelineStage`` and schedule on FSDP2-sharded
stages; the layouts refused before any profiling or rank."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from models import assert_model_unchanged, hf_llama, hf_tokens, snapshot_model

from vram_widget import measure, profile_model

pytestmark = pytest.mark.timeout(300)
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = hf_llama()
    return model, profile_model(model, inputs=hf_tokens(2), device="cpu")


def assert_every_rank_is_its_stage(model: Any, est: Any, **kwargs: Any) -> None:
    """``measure`` of the layout on real gloo ranks (a batch of 4): rank r holds stage
    r // (dp x tp), each to the byte of its stage's estimate."""
    real = measure(model, hf_tokens(4), timeout_s=120, **kwargs)
    per_stage = kwargs["gpus"] // kwargs["pp"]
    assert real.rank_peak_bytes == tuple(p for p in est.stage_peak_bytes for _ in range(per_stage))


def test_layouts_refused_before_any_rank(llama) -> None:  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    model, profile = llama
    inputs = hf_tokens(4)
    t0 = time.monotonic()
    for strategy, why in (
        ("ddp", "DistributedDataParallel over stages"),
        ("zero1", "ZeroRedundancyOptimizer over stages"),
    ):
        match = rf"pp=2 on gpus=4 with strategy='{strategy}': 2 data-parallel ranks .* {why}"
        with pytest.raises(ValueError, match=match):
            profile.estimate(4, gpus=4, pp=2, strategy=strategy)
        with pytest.raises(ValueError, match=match):
            measure(model, inputs, gpus=4, pp=2, strategy=strategy)
    with pytest.raises(ValueError, match=r"with fsdp_units: FSDP2 over pipeline stages wraps"):
        profile.estimate(4, gpus=4, pp=2, strategy="zero3", fsdp_units=["LlamaDecoderLayer"])
    with pytest.raises(ValueError, match=r"pp=2 with gpus=5: .* pp must divide it"):
        profile.estimate(4, gpus=5, pp=2, strategy="zero3")
    with pytest.raises(ValueError, match=r"no data-parallel ranks to shard over"):
        measure(model, inputs, gpus=2, pp=2, strategy="zero3")
    # with tensor-parallel stages (dp x pp x tp): the same refusals, by the 3-D layout
    for strategy in ("ddp", "zero1"):
        with pytest.raises(ValueError, match=rf"pp=2 x tp=2 on gpus=8 with strategy='{strategy}"):
            profile.estimate(4, gpus=8, pp=2, tp=2, strategy=strategy)
    # hsdp over stages: a node holds whole tensor-parallel groups of one stage, or whole
    # stages
    hsdp = {"pp": 2, "tp": 2, "strategy": "hsdp"}
    with pytest.raises(ValueError, match=r"gpus_per_node=6: hsdp shards within a node"):
        profile.estimate(4, gpus=16, gpus_per_node=6, **hsdp)
    with pytest.raises(ValueError, match=r"gpus_per_node=1: hsdp shards within a node"):
        measure(model, inputs, gpus=8, gpus_per_node=1, **hsdp)
    with pytest.raises(ValueError, match=r"pp=2 x tp=2 does not divide gpus=6"):
        profile.estimate(4, gpus=6, pp=2, tp=2, strategy="zero3")
    with pytest.raises(ValueError, match=r"rank must be None .* in \[0, 4\) for gpus=4"):
        profile.estimate(4, gpus=4, pp=2, strategy="zero3", rank=4)
    assert time.monotonic() - t0 < 5  # no stage run, no rank started
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("precision", "strategy", "schedule", "checkpoint"),
    [("fp32", "zero3", "gpipe", None), ("bf16", "zero2", "1f1b", "auto")],
)
def test_llama_ranks_against_real_fsdp_over_pipeline_stages(
    one_thread: None,
    llama,  # type: ignore[no-untyped-def]
    precision: str,
    strategy: str,
    schedule: str,
    checkpoint: str | None,
) -> None:
    # every rank to the byte; the other precision x strategy x schedule pairs, with and
    # without checkpointing, measured the same way (docs/guides/multi-gpu.md)
    import torch.distributed as dist

    model, profile = llama
    before = snapshot_model(model)
    kwargs = {"optimizer": "adamw", "gpus": 4, "pp": 2, "strategy": strategy,
              "pp_schedule": schedule, "microbatches": 2, "precision": precision,
              "checkpoint": checkpoint}  # fmt: skip
    est = profile.estimate(4, **kwargs)
    assert not dist.is_initialized()  # the fake group is gone
    itemsize = 4 if precision == "fp32" else 2
    # stage 0 on data-parallel rank 0: FSDP2 halves each parameter on dim 0 (every dim 0
    # of the embedding, 1,000 x 64, and of the layer's 9 tensors is even): (64,000 +
    # 36,992) / 2 = 50,496 elements, and AdamW's two moments of each shard 2 x 50,496; 2
    # gradient receive buffers of a micro-batch's hidden states 2 x (2 x 16 x 64) = 4,096
    # elements and the rotary embedding's two 8-element buffers, all in the precision's
    # dtype; 10 step counts in fp32 (torch/optim/optimizer.py, _get_scalar_dtype: 40 B) and
    # the ids 4 x 16 x 8 B = 512: 622,952 B in fp32, 311,752 B in bf16
    resident = (3 * 50_496 + 4_096 + 16) * itemsize + 40 + 512
    assert est.stage_resident_bytes[0] == resident
    assert precision != "fp32" or resident == 622_952
    # the worst stage is the last (its lm_head's logits); its parameters are the estimate's
    # ((36,992 + 64 + 64,000) / 2 = 50,528 elements)
    assert est.peak_bytes == est.stage_peak_bytes[1] > est.stage_peak_bytes[0]
    assert est.parameter_bytes == 50_528 * itemsize
    assert (est.gpus, est.pp, est.strategy, est.pp_schedule) == (4, 2, strategy, schedule)
    # rank r holds stage r // 2 (the (pp, dp_shard) mesh, pp outer): rank 1 is stage 0
    assert profile.estimate(4, rank=1, **kwargs).peak_bytes == est.stage_peak_bytes[0]

    real = measure(model, hf_tokens(4), timeout_s=120, **kwargs)
    assert_model_unchanged(model, before)
    assert (real.gpus, real.pp, real.strategy, len(real.rank_peak_bytes)) == (4, 2, strategy, 4)
    first, last = est.stage_peak_bytes
    assert real.rank_peak_bytes == (first, first, last, last)


@pytest.mark.slow  # first pass only: the Llama's kernels run in both (the test above)
def test_llama_ranks_against_real_amp_fsdp_over_pipeline_stages(
    one_thread: None,
    llama,  # type: ignore[no-untyped-def]
) -> None:
    # amp-bf16 over stages as torchtitan runs it: fully_shard with MixedPrecisionPolicy(
    # param_dtype=bfloat16, reduce_dtype=float32), every rank to the byte; zero2 with 1F1B
    # and checkpointing, and tensor-parallel stages (gpus=8), measured the same way
    # (docs/guides/multi-gpu.md)
    import torch.distributed as dist

    model, profile = llama
    kwargs = {"optimizer": "adamw", "gpus": 4, "pp": 2, "strategy": "zero3",
              "precision": "amp-bf16", "microbatches": 2}  # fmt: skip
    est = profile.estimate(4, **kwargs)
    assert not dist.is_initialized()
    # stage 0: the fp32 shards (50,496 elements: test above) and AdamW's two fp32 moments
    # of each; 2 gradient receive buffers of a micro-batch's hidden states in bf16, 2 x (2 x
    # 16 x 64) x 2 B = 8,192; the rotary buffers (16 x 4 B), 10 step counts (40 B) and the
    # ids (512 B): 605,952 + 8,192 + 64 + 552 = 614,760 B
    assert est.stage_resident_bytes[0] == 3 * 50_496 * 4 + 8_192 + 64 + 552 == 614_760
    assert_every_rank_is_its_stage(model, est, **kwargs)
    # amp without FSDP2 under the stages: torchtitan runs them in fp32 (no autocast with
    # pipelining alone); refused by name
    with pytest.raises(ValueError, match=r"pp=2 with precision='amp-bf16': not estimated"):
        profile.estimate(4, gpus=2, pp=2, precision="amp-bf16")


@pytest.mark.slow  # first pass only: the Llama's kernels run in both (the test above)
def test_llama_ranks_against_real_accumulation_over_pipeline_stages(
    one_thread: None,
    llama,  # type: ignore[no-untyped-def]
) -> None:
    # grad_accumulation=2 as torchtitan's train_step runs it under pipelining: the
    # schedule's step twice (each its micro-batches, FSDP2 reduce-scattering at the last
    # one's backward and adding into the gradient shards), then the optimizer; every rank
    # to the byte. The pipeline alone (GPipe), interleaved stages and tensor-parallel
    # stages with accumulation, measured the same way (docs/guides/multi-gpu.md)
    model, profile = llama
    kwargs = {"optimizer": "adamw", "gpus": 4, "pp": 2, "strategy": "zero3",
              "precision": "bf16", "pp_schedule": "1f1b", "microbatches": 2}  # fmt: skip
    est = profile.estimate(4, grad_accumulation=2, **kwargs)
    # the second schedule step holds the first one's gradient shards (the resident bytes
    # are a step's start, before any): above one step's peak on every stage
    once = profile.estimate(4, **kwargs)
    assert est.stage_resident_bytes == once.stage_resident_bytes
    assert all(a > b for a, b in zip(est.stage_peak_bytes, once.stage_peak_bytes, strict=True))
    assert_every_rank_is_its_stage(model, est, grad_accumulation=2, **kwargs)


def test_llama_ranks_against_real_fsdp_over_tensor_parallel_stages(
    one_thread: None,
    llama,  # type: ignore[no-untyped-def]
) -> None:
    # dp x pp x tp = 2 x 2 x 2 as torchtitan lays out 8 ranks: a ("pp", "dp_shard", "tp")
    # mesh, each stage sharded by the model's plan over tp, its layers checkpointed, then
    # FSDP2 over dp_shard; every rank to the byte. zero2 and bf16, GPipe, and without
    # checkpointing, measured the same way (docs/guides/multi-gpu.md)
    model, profile = llama
    kwargs = {"optimizer": "adamw", "gpus": 8, "pp": 2, "tp": 2, "strategy": "zero3",
              "pp_schedule": "1f1b", "microbatches": 2, "checkpoint": "auto"}  # fmt: skip
    est = profile.estimate(4, **kwargs)
    # stage 0 on tensor-parallel rank 0 holds 50,560 elements (the embedding's 500 x 64
    # rows, its layer's 18,560: test_pipeline_parallel.py); FSDP2 halves each on dim 0
    # (every one even): 25,280, and AdamW's two moments of each; 2 gradient receive buffers
    # of a micro-batch's whole hidden states 2 x (2 x 16 x 64) = 4,096 elements and the
    # rotary embedding's 16, fp32; 10 step counts (40 B) and the ids 4 x 16 x 8 B = 512:
    # (3 x 25,280 + 4,112) x 4 + 552 = 320,360 B
    assert est.stage_resident_bytes[0] == (3 * 25_280 + 4_112) * 4 + 552 == 320_360
    # the last stage: its layer, the final norm and lm_head's rows, 50,624 / 2 elements
    assert est.parameter_bytes == 25_312 * 4
    assert (est.gpus, est.pp, est.tp, est.strategy) == (8, 2, 2, "zero3")
    # rank r holds stage r // (dp x tp): rank 3 is stage 0, rank 4 stage 1
    for rank, stage in ((3, 0), (4, 1)):
        other = profile.estimate(4, rank=rank, **kwargs)
        assert other.peak_bytes == est.stage_peak_bytes[stage]
    assert_every_rank_is_its_stage(model, est, **kwargs)


@pytest.mark.slow  # first pass only: the Llama's kernels run in both (the test above)
def test_llama_ranks_against_real_fsdp_over_interleaved_stages(
    one_thread: None,
    llama,  # type: ignore[no-untyped-def]
) -> None:
    # ScheduleInterleaved1F1B with 2 stages a rank, each stage its own FSDP2 root over the
    # rank's dp_shard ranks (torchtitan's parallelize function runs on each model part):
    # every rank to the byte. bf16 with 4 micro-batches, zero2 with checkpointing, and
    # with tensor-parallel stages (gpus=8, tp=2), measured the same way
    # (docs/guides/multi-gpu.md)
    model, profile = llama
    kwargs = {"optimizer": "adamw", "gpus": 4, "pp": 2, "strategy": "zero3",
              "pp_schedule": "interleaved-1f1b", "microbatches": 2}  # fmt: skip
    est = profile.estimate(4, **kwargs)
    assert (est.stages_per_rank, est.strategy) == (2, "zero3")
    # rank 1 is pipeline rank 0 (stages 0 and 2), rank 2 pipeline rank 1 (stages 1 and 3)
    assert profile.estimate(4, rank=1, **kwargs).peak_bytes == est.stage_peak_bytes[0]
    assert_every_rank_is_its_stage(model, est, **kwargs)


@pytest.mark.slow  # first pass only: the Llama's kernels run in both (the test above)
def test_llama_ranks_against_real_hsdp_over_pipeline_stages(
    one_thread: None,
    llama,  # type: ignore[no-untyped-def]
) -> None:
    # hsdp over each stage's 4 ranks: a ("pp", "dp_replicate", "dp_shard") mesh, nodes of 2
    # GPUs (2 shard ranks, 2 replicas a stage), fully_shard on the (dp_replicate, dp_shard)
    # sub-mesh as torchtitan's apply_fsdp takes it; every rank to the byte. bf16 with 1F1B
    # and checkpointing, interleaved stages, and 16 ranks with tp=2 (nodes of 4), measured
    # the same way (docs/guides/multi-gpu.md)
    model, profile = llama
    kwargs = {"optimizer": "adamw", "gpus": 8, "pp": 2, "strategy": "hsdp",
              "gpus_per_node": 2, "microbatches": 2}  # fmt: skip
    est = profile.estimate(4, **kwargs)
    # a shard rank holds what FSDP2 over the 2 ranks of a node holds (the replicas'
    # all-reduce is in place): the stages of zero3 over 2 data-parallel ranks
    sharded = profile.estimate(4, **{**kwargs, "gpus": 4, "strategy": "zero3"})
    assert est.stage_peak_bytes == sharded.stage_peak_bytes
    assert (est.gpus, est.strategy) == (8, "hsdp")
    assert_every_rank_is_its_stage(model, est, **kwargs)


def test_live_bytes_follow_a_storage_resized_in_place() -> None:
    # FSDP2 frees and remakes its gathered parameters with UntypedStorage.resize_, which no
    # dispatch mode sees: the count follows it while on, and leaves resize_ as it was
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vram_widget._profiling.live_bytes import LiveBytes

    original = torch.UntypedStorage.resize_
    counter = LiveBytes()
    with FakeTensorMode():
        with counter:
            t = torch.empty(100)  # 100 x 4 B = 400 B, tracked as an op's output
            assert counter.live_bytes == 400
            t.untyped_storage().resize_(0)  # free_storage
            assert counter.live_bytes == 0
            t.untyped_storage().resize_(400)  # alloc_storage
            assert (counter.live_bytes, counter.peak_bytes) == (400, 400)
        del t
    assert counter.live_bytes == 0  # freed at its last size
    assert torch.UntypedStorage.resize_ is original


def test_live_bytes_count_cuda_blocks() -> None:
    # cuda=True (a float8 all-gather rank on device="cuda"): each storage also counts as
    # the caching allocator's block, its bytes rounded up to a multiple of 512 (none for an
    # empty storage), and the CPU's within-call bytes of a wrapped Python number are left
    # out (on the CPU, x * 1.5 on 100 floats peaks at 400 + 400 + 8 + 4 = 812 B)
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vram_widget._profiling.live_bytes import LiveBytes

    for cuda, within in ((False, 12), (True, 0)):
        counter = LiveBytes(cuda=cuda)
        with FakeTensorMode(), counter:
            t = torch.empty(100)  # 400 B: one 512-byte block
            scaled = t * 1.5  # 400 B more
            assert counter.peak_bytes == 800 + within
            del scaled
            t.untyped_storage().resize_(0)  # freed: no block
            assert (counter.live_bytes, counter.live_blocks) == (0, 0)
            t.untyped_storage().resize_(600)  # 600 B: two blocks, 1,024 B
            assert counter.live_bytes == 600
            # the blocks' peak: 512 + 512 with both tensors live, then 1,024
            assert (counter.live_blocks, counter.peak_blocks) == ((1024, 1024) if cuda else (0, 0))
            del t
        assert (counter.live_bytes, counter.live_blocks) == (0, 0)


@pytest.mark.parametrize(("dtype", "averaged_bytes"), [(torch.float32, 12), (torch.bfloat16, 10)])
def test_gloo_reduce_scatter_staging_counts_its_average(
    dtype: torch.dtype, averaged_bytes: int
) -> None:
    # gloo reduces a copy of the input, then with ReduceOp.AVG divides it by the group's
    # size in place: an 8-byte wrapped number and its cast to the dtype (4 B fp32, 2 B bf16)
    # beside the copy. A 1,000-element input over 2 ranks: its copy 1,000 x itemsize, the
    # output 500 x itemsize live from the call on
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vram_widget._profiling.live_bytes import LiveBytes
    from vram_widget._profiling.pipeline_fsdp import GLOO_STAGING
    from vram_widget._profiling.tensor_parallel import fake_process_group

    itemsize = torch.empty(0, dtype=dtype).element_size()
    with fake_process_group(2), FakeTensorMode():
        inp = torch.empty(1_000, dtype=dtype)
        for op, extra in ((dist.ReduceOp.SUM, 0), (dist.ReduceOp.AVG, averaged_bytes)):
            counter = LiveBytes()
            counter.staging = dict(GLOO_STAGING)
            counter.track(inp)
            with counter:
                out = torch.empty(500, dtype=dtype)
                dist.reduce_scatter_single(out, inp, op=op)  # as FSDP2 calls it
            assert counter.peak_bytes == 1_500 * itemsize + 1_000 * itemsize + extra
            del out
