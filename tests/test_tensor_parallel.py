"""Tensor parallelism: one rank's estimate from a sub-profile sharded by DTensor on PyTorch's
fake process group, and the layouts refused before any profiling."""

from __future__ import annotations

import pytest
import torch
from models import assert_model_unchanged, hf_llama, hf_tokens, snapshot_model

from vram_widget import profile_model

pytestmark = pytest.mark.timeout(300)
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama_profile():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    return profile_model(hf_llama(), inputs=hf_tokens(2), device="cpu")


def test_rank_holds_its_shard_of_the_parameters(llama_profile) -> None:  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    est = llama_profile.estimate(2, "fp32", mode="inference", gpus=2, tp=2)
    full = llama_profile.estimate(2, "fp32", mode="inference")
    # Llama's plan shards every Linear and the embedding over 2 ranks and replicates the
    # 5 RMSNorm weights of 64 (2 per layer x 2 layers + the final norm): 5 x 64 x 4 B =
    # 1,280 B on every rank, the other 808,192 - 1,280 = 806,912 B halved: 403,456 + 1,280
    assert full.parameter_bytes == 808_192
    assert est.parameter_bytes == 403_456 + 1_280
    assert (est.gpus, est.tp) == (2, 2)
    assert est.peak_bytes < full.peak_bytes
    assert not dist.is_initialized()  # the fake group is gone


def test_rank_gradients_are_the_real_ranks_grads(one_thread: None, llama_profile) -> None:  # type: ignore[no-untyped-def]
    # Every gradient is its parameter's local shard (404,736 B in all, as the parameters
    # above) but the embedding's: its weight is vocabulary-parallel (500 x 64 rows here),
    # and DTensor hands back its gradient Replicate, the whole 1,000 x 64 x 4 B = 256,000 B
    # on every rank (torch/distributed/tensor/_ops/_embedding_ops.py,
    # embedding_dense_backward_strategy: a gradient sharded on dim 1 or Partial, never on
    # the rows; with the output's gradient and the ids replicated, all-Replicate is taken).
    # 404,736 + (256,000 - 128,000) = 532,736 B, what the gloo ranks' .grad tensors hold.
    from vram_widget._profiling.distributed import run_ranks
    from vram_widget._profiling.tensor_parallel import local_part, rank_setup, resolve_plan

    est = llama_profile.estimate(2, optimizer="sgd", gpus=2, tp=2)
    assert est.parameter_bytes == 404_736
    assert est.gradient_bytes == 404_736 + 128_000
    torch.manual_seed(0)
    model = hf_llama()
    setup = rank_setup(resolve_plan(model, 2), 2)

    def rank_grads(_rank: int, _world: int) -> dict[str, tuple[tuple[int, ...], int]]:
        sharded = setup.wrap_model(model, None, None)  # type: ignore[arg-type]
        sharded(**hf_tokens(2)).loss.backward()
        grads = {n: local_part(p.grad) for n, p in sharded.named_parameters()}
        return {n: (tuple(g.shape), g.untyped_storage().nbytes()) for n, g in grads.items()}

    for grads in run_ranks(rank_grads, 2, timeout_s=120):
        assert grads["model.embed_tokens.weight"] == ((1_000, 64), 256_000)
        assert sum(nbytes for _shape, nbytes in grads.values()) == est.gradient_bytes


def test_bad_layouts_are_refused_by_name(llama_profile) -> None:  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    with pytest.raises(ValueError, match=r"tp=2 with gpus=1: gpus is the world size"):
        llama_profile.estimate(2, tp=2)
    with pytest.raises(ValueError, match=r"tp=2 with gpus=3"):
        llama_profile.estimate(2, gpus=3, tp=2)
    # data parallelism over tensor-parallel ranks: FSDP2 and HSDP only, as torchtitan composes
    # them (test_fsdp_tensor_parallel.py)
    for strategy in ("ddp", "zero1"):
        with pytest.raises(ValueError, match=rf"strategy='{strategy}': 2 data-parallel ranks"):
            llama_profile.estimate(2, gpus=4, tp=2, strategy=strategy)
    with pytest.raises(ValueError, match=r"strategy='zero3': every rank is a tensor-parallel"):
        llama_profile.estimate(2, gpus=2, tp=2, strategy="zero3")
    # 4 heads, 2 key/value heads: tp=4 does not divide the key/value heads
    with pytest.raises(ValueError, match=r"tp=4 does not divide the model's num_key_value_heads=2"):
        llama_profile.estimate(2, gpus=4, tp=4, mode="inference")
    with pytest.raises(ValueError, match=r"tp must be a whole number"):
        llama_profile.estimate(2, gpus=2, tp=0)
    assert not dist.is_initialized()


def test_a_model_without_a_plan_is_refused() -> None:
    from vram_widget import zoo

    entry = zoo.ZOO["mlp"]
    profile = profile_model(entry.build(), inputs=entry.make_inputs(2), device="cpu")
    with pytest.raises(ValueError, match=r"has no tensor-parallel plan"):
        profile.estimate(2, gpus=2, tp=2, mode="inference")


def test_the_fake_group_never_leaks() -> None:
    import torch.distributed as dist

    from vram_widget._profiling.tensor_parallel import fake_process_group

    with pytest.raises(KeyError), fake_process_group(2):
        assert dist.is_initialized()
        raise KeyError("midway")
    assert not dist.is_initialized()
    # a process already in a group: refused, its group left as it was
    with fake_process_group(2):
        with (
            pytest.raises(RuntimeError, match=r"already in a torch\.distributed process group"),
            fake_process_group(2),
        ):
            pass
        assert dist.is_initialized()
    assert not dist.is_initialized()


# Every rank's measured peak against its estimate: measured 0 B apart in each case below
# (docs/guides/multi-gpu.md); a bound far below one activation of these models (8 KiB)
TP_SLACK_BYTES = 1024


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["train", "inference"])
def test_llama_ranks_against_real_tensor_parallel_ranks(
    one_thread: None, precision: str, mode: str
) -> None:
    # transformers' own plan (colwise q/k/v, gate, up; rowwise o, down; the embedding
    # vocabulary-parallel; lm_head gathered) on 2 real gloo ranks, AdamW in training
    from vram_widget import measure

    torch.manual_seed(0)
    model = hf_llama()
    inputs = hf_tokens(2)
    before = snapshot_model(model)
    optimizer = "adamw" if mode == "train" else None
    kwargs = {"precision": precision, "mode": mode, "optimizer": optimizer, "gpus": 2, "tp": 2}
    est = profile_model(model, inputs=inputs, device="cpu").estimate(2, **kwargs)
    real = measure(model, inputs, timeout_s=120, **kwargs)
    assert_model_unchanged(model, before)
    assert (real.gpus, real.tp, real.strategy, len(real.rank_peak_bytes)) == (2, 2, None, 2)
    for peak in real.rank_peak_bytes:
        assert abs(peak - est.peak_bytes) <= TP_SLACK_BYTES, (peak, est.peak_bytes)


def test_a_plan_of_parallel_styles(one_thread: None) -> None:
    # a user's plan of torch.distributed.tensor.parallel styles, applied by parallelize_module
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from vram_widget import measure

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    x = torch.randn(4, 32)
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    profile = profile_model(model, inputs=x, device="cpu")
    est = profile.estimate(4, optimizer="adamw", gpus=2, tp=2, tp_plan=plan)
    # colwise: weight 64 x 32 -> 32 x 32, bias 64 -> 32; rowwise: weight 32 x 64 -> 32 x 32,
    # bias 32 replicated: (1,024 + 32 + 1,024 + 32) x 4 B = 8,448 B
    assert est.parameter_bytes == 8_448
    real = measure(model, x, optimizer="adamw", gpus=2, tp=2, tp_plan=plan, timeout_s=60)
    for peak in real.rank_peak_bytes:
        assert abs(peak - est.peak_bytes) <= TP_SLACK_BYTES, (peak, est.peak_bytes)
    odd = nn.Sequential(nn.Linear(32, 63), nn.ReLU(), nn.Linear(63, 32))
    with pytest.raises(ValueError, match=r"tp=2 does not divide 0\.out_features=63"):
        profile_model(odd, inputs=x, device="cpu").estimate(4, gpus=2, tp=2, tp_plan=plan)
    with pytest.raises(TypeError, match=r"tp_plan\['0'\] is a str"):
        profile.estimate(4, gpus=2, tp=2, tp_plan={"0": "colwise"})
    with pytest.raises(ValueError, match=r"tp_plan pattern 'nope' matches no module"):
        profile.estimate(4, gpus=2, tp=2, tp_plan={"nope": ColwiseParallel()})


def test_a_foreach_step_over_dtensors_and_plain_tensors_is_refused() -> None:
    # A plan that leaves a parameter plain (the LayerNorm's) gives the rank a parameter
    # group mixing DTensors and plain tensors: torch.optim's foreach step (its default on
    # CUDA) and its fused step raise "got mixed torch.Tensor and DTensor" on such a group, in
    # torch's own step as in the fake one; the for-loop step takes one parameter at a time.
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.LayerNorm(32))
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    profile = profile_model(model, inputs=torch.randn(4, 32), device="cuda")
    layout = {"gpus": 2, "tp": 2, "tp_plan": plan}
    for optimizer, kind in (("adamw", "foreach"), ("adamw-fused", "fused")):
        with pytest.raises(ValueError, match=rf"with torch.optim's {kind} step cannot step") as e:
            profile.estimate(4, optimizer=optimizer, **layout)
        assert "plain tensors (3.weight, 3.bias)" in str(e.value)
        assert "optimizer='adamw-forloop'" in str(e.value)
    est = profile.estimate(4, optimizer="adamw-forloop", **layout)
    # colwise and rowwise as above (8,448 B) and the LayerNorm's 2 x 32 x 4 B = 256 B, whole
    assert est.parameter_bytes == 8_448 + 256


def test_measure_refuses_bad_layouts_before_any_rank() -> None:
    import time

    from vram_widget import measure

    torch.manual_seed(0)
    model, inputs = hf_llama(), hf_tokens(2)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"tp=2 with gpus=1"):
        measure(model, inputs, tp=2)
    with pytest.raises(ValueError, match=r"num_key_value_heads=2"):
        measure(model, inputs, gpus=4, tp=4)
    with pytest.raises(ValueError, match=r"strategy='zero2'"):
        measure(model, inputs, gpus=2, tp=2, strategy="zero2")
    assert time.monotonic() - t0 < 10  # no rank started


def test_levers_not_checked_against_real_ranks_are_refused(llama_profile) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=r"tp=2 with offload_activations, optimizer_in_backward"):
        llama_profile.estimate(
            2, gpus=2, tp=2, loss_chunks=2, offload_activations=True, optimizer_in_backward=True
        )
    with pytest.raises(ValueError, match=r"loss_chunks with tp=2 on gpus=4: the chunked loss"):
        llama_profile.estimate(2, gpus=4, tp=2, strategy="zero3", loss_chunks=2)
    with pytest.raises(ValueError, match=r"tp=2 with compile: not estimated"):
        llama_profile.estimate(2, gpus=2, tp=2, lora_rank=4, compile=True)


def test_lora_layouts_peft_does_not_shard_are_refused(llama_profile) -> None:  # type: ignore[no-untyped-def]
    from torch.distributed.tensor.parallel import ColwiseParallel

    from vram_widget import measure

    plan = {"model.layers.*.self_attn.q_proj": ColwiseParallel()}
    with pytest.raises(ValueError, match=r"lora_rank with tp=2 and a tp_plan of your own"):
        llama_profile.estimate(2, gpus=2, tp=2, tp_plan=plan, lora_rank=4)
    with pytest.raises(ValueError, match=r"lora_rank with tp=2 on gpus=4: LoRA with FSDP2"):
        llama_profile.estimate(2, gpus=4, tp=2, strategy="zero3", lora_rank=4)
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"lora_rank with tp=2 and a tp_plan of your own"):
        measure(hf_llama(), hf_tokens(2), gpus=2, tp=2, tp_plan=plan, lora_rank=4)
    # the plan's head gathers its output ('colwise_gather_output'): PEFT makes no layout
    with pytest.raises(ValueError, match=r"lm_head is sharded by 'colwise_gather_output'"):
        llama_profile.estimate(2, gpus=2, tp=2, lora_rank=4, lora_targets=["lm_head"])


def test_lora_and_chunked_loss_on_tensor_parallel_ranks(one_thread: None) -> None:
    # PEFT (0.21.2, add_lora_tp_hooks_dtensor) shards the adapter on a sharded layer's
    # sharded side. Its Llama targets, q_proj and v_proj, are colwise: lora_A (4 x 64) whole
    # on each rank, lora_B Shard(0) of q's 64 / 2 and v's 32 / 2 rows x 4. A layer holds
    # 256 + 32 x 4 + 256 + 16 x 4 = 704 floats, 2 layers 1,408 x 4 B = 5,632 B: the
    # gradients (the base is frozen) and, beside the 404,736 B of base shards, the
    # parameters; AdamW's two moments 11,264 B and its 8 fp32 step counts 32 B.
    # The plan's lm_head is 'colwise_gather_output': each rank all-gathers its 500 of the
    # 1,000 vocabulary columns, so every rank holds whole logits, a chunk at a time with
    # loss_chunks; it sends its 2 x 16 x 500 x 4 B = 64,000 B of logits either way (two
    # gathers of 32,000 B when chunked).
    from vram_widget import measure
    from vram_widget._estimating.communication import CollectiveKind

    torch.manual_seed(0)
    model, inputs = hf_llama(), hf_tokens(2)
    kwargs = {"optimizer": "adamw", "gpus": 2, "tp": 2, "lora_rank": 4}
    profile = profile_model(model, inputs=inputs, device="cpu")
    est = profile.estimate(2, **kwargs)
    assert est.gradient_bytes == 5_632
    assert est.parameter_bytes == 404_736 + 5_632
    assert est.optimizer_state_bytes == 11_264 + 32
    chunked = profile.estimate(2, loss_chunks=2, **kwargs)
    for e in (est, chunked):
        assert e.communication_sent_bytes_by_kind[CollectiveKind.ALL_GATHER] == 64_000
    assert chunked.peak_bytes < est.peak_bytes  # the peak is in the loss's backward
    snapshot = snapshot_model(model)
    real = measure(model, inputs, timeout_s=120, **kwargs)
    assert real.rank_peak_bytes == (est.peak_bytes, est.peak_bytes)
    real = measure(model, inputs, timeout_s=120, loss_chunks=2, **kwargs)
    assert real.rank_peak_bytes == (chunked.peak_bytes, chunked.peak_bytes)
    assert_model_unchanged(model, snapshot)


@pytest.mark.parametrize(
    "levers",
    [
        {"checkpoint": "auto"},
        {"trainable": ["lm_head.*"]},
        {"precision": "amp-bf16"},
        {"grad_accumulation": 2},
    ],
    ids=["checkpoint", "frozen", "amp-bf16", "accumulation"],
)
def test_levers_with_tensor_parallel_ranks(one_thread: None, levers: dict[str, object]) -> None:
    # the levers applied inside each real rank, against the rank's estimate (every step of
    # a rank reads the same bytes: its collectives free their buffers on its own thread)
    from vram_widget import measure

    torch.manual_seed(0)
    model, inputs = hf_llama(), hf_tokens(2)
    kwargs = {"optimizer": "adamw", "gpus": 2, "tp": 2, **levers}
    est = profile_model(model, inputs=inputs, device="cpu").estimate(2, **kwargs)
    real = measure(model, inputs, timeout_s=120, **kwargs)
    for peak in real.rank_peak_bytes:
        assert abs(peak - est.peak_bytes) <= TP_SLACK_BYTES, (peak, est.peak_bytes)


@pytest.mark.parametrize("mode", ["train", "inference"])
def test_sequence_parallel_styles_against_real_ranks(one_thread: None, mode: str) -> None:
    # The Shard(1) -> Partial reduce-scatter of the last Linear's output: on a CPU profile
    # the estimate holds gloo's staging clone of its whole input (cpu_rules.
    # gloo_staging_bytes): SequenceParallel reads the 4 x 8 x 32 input as one rank's
    # shard of 4 x 16 x 32, so the clone is 4 x 16 x 32 x 4 B = 8,192 B, and the ranks
    # measured 8,192 B (inference) and 3,960 B (training, where the peak moves) above an
    # estimate without it
    from torch import nn
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    from vram_widget import measure

    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    x = torch.randn(4, 8, 32)
    plan = {
        "0": SequenceParallel(),
        "1": ColwiseParallel(input_layouts=Shard(1)),
        "3": RowwiseParallel(output_layouts=Shard(1)),
    }
    optimizer = "adamw" if mode == "train" else None
    kwargs = {"mode": mode, "optimizer": optimizer, "gpus": 2, "tp": 2, "tp_plan": plan}
    profile = profile_model(model, inputs=x, device="cpu")
    est = profile.estimate(4, **kwargs)
    real = measure(model, x, timeout_s=60, **kwargs)
    assert real.rank_peak_bytes == (est.peak_bytes, est.peak_bytes)


def test_the_same_question_is_answered_from_memory(llama_profile) -> None:  # type: ignore[no-untyped-def]
    import time

    t0 = time.monotonic()
    first = llama_profile.estimate(3, mode="inference", gpus=2, tp=2)
    t1 = time.monotonic()
    again = llama_profile.estimate(3, mode="inference", gpus=2, tp=2)
    t2 = time.monotonic()
    assert (again.peak_bytes, again.parameter_bytes) == (first.peak_bytes, first.parameter_bytes)
    assert t2 - t1 < (t1 - t0) / 5  # no second profile
