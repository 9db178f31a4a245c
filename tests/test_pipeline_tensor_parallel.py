"""Tensor parallelism inside pipeline stages (gpus = pp x tp): each stage sharded by the
model's plan on the tp sub-mesh of a (pp, tp) mesh, on fake tensors, against real gloo
ranks; the layouts refused before any profiling or rank."""

from __future__ import annotations

import time

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


def test_layouts_refused_before_any_rank(llama) -> None:  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    model, profile = llama
    inputs = hf_tokens(4)
    t0 = time.monotonic()
    cases = [
        ({"gpus": 8, "strategy": "zero3"}, r"pp=2 x tp=2 != gpus=8: .* FSDP2 over the 2 "),
        ({"gpus": 4, "strategy": "zero3"}, r"strategy='zero3': every rank is a tensor-parallel"),
        ({"gpus": 4, "pp_schedule": "interleaved-1f1b"}, r"tensor-parallel ranks of a multi-"),
        ({"gpus": 4, "tp_plan": {"lm_head": object()}}, r"tp=2 and tp_plan: pipeline stages"),
        ({"gpus": 4, "lora_rank": 4}, r"pp=2 with lora_rank"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            profile.estimate(4, tp=2, pp=2, **kwargs)
        with pytest.raises(ValueError, match=match):
            measure(model, inputs, tp=2, pp=2, **kwargs)
    # the model's 4 attention heads: tp=3 does not divide them
    heads = r"tp=3 does not divide the model's num_attention_heads=4"
    with pytest.raises(ValueError, match=heads):
        profile.estimate(4, gpus=6, tp=3, pp=2)
    with pytest.raises(ValueError, match=heads):
        measure(model, inputs, gpus=6, tp=3, pp=2)
    assert time.monotonic() - t0 < 5  # no stage run, no rank started
    assert not dist.is_initialized()


def test_stage_plan_keeps_the_modules_a_stage_holds() -> None:
    from vram_widget._profiling.pipeline_parallel import stage_copy
    from vram_widget._profiling.pipeline_tensor_parallel import stage_plan

    model = hf_llama()
    first = stage_plan(stage_copy(model, 0, 2, meta=True).model, 2)
    last = stage_plan(stage_copy(model, 1, 2, meta=True).model, 2)
    # the first stage: the embedding and its one layer (renumbered 0), no head (Identity)
    assert first["model.embed_tokens"] == "embedding_rowwise" and "lm_head" not in first
    assert first["model.layers.0.self_attn.o_proj"] == "rowwise"
    assert not any(name.startswith("model.layers.1.") for name in first)
    # the last: its layer (renumbered 0) and the head, no embedding
    assert last["lm_head"] == "colwise_gather_output" and "model.embed_tokens" not in last
    assert last["model.layers.0.mlp.gate_proj"] == "colwise"


@pytest.mark.slow
def test_llama_ranks_against_real_tensor_parallel_pipeline_stages(
    one_thread: None,
    llama,  # type: ignore[no-untyped-def]
) -> None:
    # every rank to the byte, bf16 with 1F1B and every layer checkpointed; fp32 and bf16
    # with GPipe and 1F1B, with and without checkpointing, measured the same way
    # (docs/guides/multi-gpu.md)
    import torch.distributed as dist

    model, profile = llama
    before = snapshot_model(model)
    kwargs = {"optimizer": "adamw", "gpus": 4, "tp": 2, "pp": 2, "pp_schedule": "1f1b",
              "microbatches": 2, "precision": "bf16", "checkpoint": "auto"}  # fmt: skip
    est = profile.estimate(4, **kwargs)
    assert not dist.is_initialized()  # the fake group is gone
    # stage 0 on tensor-parallel rank 0: the embedding's rows halved (500 x 64 = 32,000);
    # its layer's q (64 x 64), k and v (64 x 32 each), gate and up (64 x 128) halved on
    # their outputs, o (64 x 64) and down (128 x 64) on their inputs, 2 norms of 64 whole:
    # 2,048 + 2 x 1,024 + 2 x 4,096 + 2,048 + 4,096 + 128 = 18,560; 50,560 elements, and
    # AdamW's two moments of each; 2 gradient receive buffers of a micro-batch's hidden
    # states, whole on every tensor-parallel rank: 2 x (2 x 16 x 64) = 4,096 elements; the
    # rotary embedding's two 8-element buffers; all bf16; 10 fp32 step counts (40 B) and
    # the ids 4 x 16 x 8 B = 512: 312,136 B
    assert est.stage_resident_bytes[0] == (3 * 50_560 + 4_096 + 16) * 2 + 40 + 512 == 312_136
    # the last stage: its layer (18,560), the final norm (64) and lm_head's rows halved
    # (500 x 64): 50,624 elements of 2 B; it peaks above the first (its logits)
    assert est.parameter_bytes == 50_624 * 2
    assert est.peak_bytes == est.stage_peak_bytes[1] > est.stage_peak_bytes[0]
    assert (est.gpus, est.tp, est.pp, est.pp_schedule) == (4, 2, 2, "1f1b")
    # rank r holds stage r // 2 (the (pp, tp) mesh, tp inner): rank 1 is stage 0
    assert profile.estimate(4, rank=1, **kwargs).peak_bytes == est.stage_peak_bytes[0]

    real = measure(model, hf_tokens(4), timeout_s=120, **kwargs)
    assert_model_unchanged(model, before)
    assert (real.gpus, real.tp, real.pp, len(real.rank_peak_bytes)) == (4, 2, 2, 4)
    first, last = est.stage_peak_bytes
    assert real.rank_peak_bytes == (first, first, last, last)
