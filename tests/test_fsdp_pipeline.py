"""FSDP2 over pipeline stages (``gpus = dp x pp``, ``strategy="zero2"|"zero3"``): each
stage's step on fake tensors with ``fully_shard`` over the stage's data-parallel ranks,
against 4 real gloo ranks running torch's ``PipelineStage`` and schedule on FSDP2-sharded
stages; the layouts refused before any profiling or rank."""

from __future__ import annotations

import time

import pytest
import torch
from models import assert_model_unchanged, hf_llama, hf_tokens, snapshot_model

from vram_widget import measure, profile_model

pytestmark = pytest.mark.timeout(300)
pytest.importorskip("transformers")

# What real ranks hold above each stage's estimate: the same as with the pipeline alone
# (gpus=2, pp=2, the same micro-batches: measured), so FSDP2's part adds nothing. Measured on
# the fp32 Llama of tests/models.py, micro-batches of 2 x 16 tokens, GPipe and 1F1B, zero2
# and zero3:
# - the first stage's ranks 12 B above: an 8-byte tensor of a Python number and its 4-byte
#   fp32 cast, made below the dispatcher inside one op at the peak (here gloo's averaging
#   div_ after the root's reduce-scatter; AdamW's step with the pipeline alone), which the
#   fake step does not make;
# - the last stage's ranks 10,240 B below (one micro-batch's hidden states, 2 x 16 x 64 x
#   4 B = 8,192, and 2,048): the pipeline alone's residual on that stage, not explained
#   yet (docs/known-gaps.md).
FIRST_STAGE_ABOVE_BYTES = 12
LAST_STAGE_BELOW_BYTES = 8_192 + 2_048


@pytest.fixture(scope="module")
def llama():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = hf_llama()
    return model, profile_model(model, inputs=hf_tokens(2), device="cpu")


def test_layouts_refused_before_any_rank(llama) -> None:  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    model, profile = llama
    inputs = hf_tokens(4)
    t0 = time.monotonic()
    for strategy, why in (
        ("ddp", "DistributedDataParallel over stages"),
        ("zero1", "ZeroRedundancyOptimizer over stages"),
        ("hsdp", "HSDP over stages"),
    ):
        match = rf"pp=2 on gpus=4 with strategy='{strategy}': 2 data-parallel ranks .* {why}"
        with pytest.raises(ValueError, match=match):
            profile.estimate(4, gpus=4, pp=2, strategy=strategy)
        with pytest.raises(ValueError, match=match):
            measure(model, inputs, gpus=4, pp=2, strategy=strategy)
    interleaved = r"pp_schedule='interleaved-1f1b': FSDP2 over the stages of a multi-stage"
    with pytest.raises(ValueError, match=interleaved):
        profile.estimate(4, gpus=4, pp=2, strategy="zero3", pp_schedule="interleaved-1f1b")
    with pytest.raises(ValueError, match=r"with fsdp_units: FSDP2 over pipeline stages wraps"):
        profile.estimate(4, gpus=4, pp=2, strategy="zero3", fsdp_units=["LlamaDecoderLayer"])
    with pytest.raises(ValueError, match=r"pp=2 with gpus=5: .* pp must divide it"):
        profile.estimate(4, gpus=5, pp=2, strategy="zero3")
    with pytest.raises(ValueError, match=r"no data-parallel ranks to shard over"):
        measure(model, inputs, gpus=2, pp=2, strategy="zero3")
    with pytest.raises(ValueError, match=r"pp=2 with checkpoint: not estimated"):
        profile.estimate(4, gpus=4, pp=2, strategy="zero3", checkpoint="auto")
    with pytest.raises(ValueError, match=r"rank must be None .* in \[0, 4\) for gpus=4"):
        profile.estimate(4, gpus=4, pp=2, strategy="zero3", rank=4)
    assert time.monotonic() - t0 < 5  # no stage run, no rank started
    assert not dist.is_initialized()


def test_llama_ranks_against_real_fsdp_over_pipeline_stages(
    one_thread: None,
    llama,  # type: ignore[no-untyped-def]
) -> None:
    # zero3 with GPipe here; zero2, and 1F1B, measured with the same residuals
    # (docs/guides/multi-gpu.md)
    import torch.distributed as dist

    model, profile = llama
    strategy, schedule = "zero3", "gpipe"
    before = snapshot_model(model)
    kwargs = {"optimizer": "adamw", "gpus": 4, "pp": 2, "strategy": strategy,
              "pp_schedule": schedule, "microbatches": 2}  # fmt: skip
    est = profile.estimate(4, **kwargs)
    assert not dist.is_initialized()  # the fake group is gone
    # stage 0 on data-parallel rank 0: FSDP2 halves each parameter on dim 0 (every dim 0
    # of the embedding, 1,000 x 64, and of the layer's 9 tensors is even): (64,000 +
    # 36,992) / 2 = 50,496 floats = 201,984 B, AdamW's two moments of each shard 2 x
    # 201,984 and 10 fp32 step counts (40 B), the ids 4 x 16 x 8 B = 512, 2 gradient
    # receive buffers of a micro-batch's hidden states 2 x (2 x 16 x 64 x 4 B) = 16,384
    # and the rotary embedding's two 8-float buffers (64 B): 622,952 B
    assert est.stage_resident_bytes[0] == 3 * 201_984 + 40 + 512 + 16_384 + 64 == 622_952
    # the worst stage is the last (its lm_head's logits); its parameters are the estimate's
    # ((36,992 + 64 + 64,000) / 2 x 4 B = 202,112)
    assert est.peak_bytes == est.stage_peak_bytes[1] > est.stage_peak_bytes[0]
    assert est.parameter_bytes == 202_112
    assert (est.gpus, est.pp, est.strategy, est.pp_schedule) == (4, 2, strategy, schedule)
    # rank r holds stage r // 2 (the (pp, dp_shard) mesh, pp outer): rank 1 is stage 0
    assert profile.estimate(4, rank=1, **kwargs).peak_bytes == est.stage_peak_bytes[0]

    real = measure(model, hf_tokens(4), timeout_s=120, **kwargs)
    assert_model_unchanged(model, before)
    assert (real.gpus, real.pp, real.strategy, len(real.rank_peak_bytes)) == (4, 2, strategy, 4)
    first, last = est.stage_peak_bytes
    assert real.rank_peak_bytes == (
        first + FIRST_STAGE_ABOVE_BYTES,
        first + FIRST_STAGE_ABOVE_BYTES,
        last - LAST_STAGE_BELOW_BYTES,
        last - LAST_STAGE_BELOW_BYTES,
    )


def test_live_bytes_follow_a_storage_resized_in_place() -> None:
    # FSDP2 frees and remakes its gathered parameters with UntypedStorage.resize_, which no
    # dispatch mode sees: the count follows it while on, and leaves resize_ as it was
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vram_widget._profiling.pipeline_parallel import LiveBytes

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
