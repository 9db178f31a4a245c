"""Real torch.distributed runs: the ranks of ``measure(gpus=N)`` and the estimate against them.

Each test forks its ranks (gloo on 127.0.0.1 at a free port), bounded in time; every process
is stopped by its PID. The estimate of one rank comes from the single-device profile; the
truth is DistributedDataParallel itself, wrapping a copy of the model in each rank.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from models import assert_model_unchanged, hf_llama, hf_tokens, snapshot_model

from vram_widget import measure, profile_model, zoo
from vram_widget._profiling.distributed import DistributedError, run_ranks

pytestmark = pytest.mark.timeout(300)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie has exited; run_ranks joins its children, so none should be left
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def _rank_pid(rank: int, world: int) -> tuple[int, int, int]:
    import torch.distributed as dist

    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return rank, world, int(t.item()) * 1000 + os.getpid() % 1000


def test_ranks_answer_in_order_and_reduce_together() -> None:
    out = run_ranks(_rank_pid, 3, timeout_s=60)
    # all_reduce of 1 + 2 + 3 = 6 in every rank
    assert [(r, w, v // 1000) for r, w, v in out] == [(0, 3, 6), (1, 3, 6), (2, 3, 6)]


def _fails_on_rank_one(rank: int, _world: int) -> int:
    if rank == 1:
        raise ValueError("rank one's own message")
    time.sleep(30)  # the other rank would wait: it is killed instead
    return rank


def _pids_of_children() -> set[int]:
    me = os.getpid()
    pids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().split()
            except OSError:
                continue
            if int(fields[3]) == me:
                pids.add(int(entry))
    return pids


def test_a_failing_rank_raises_its_own_error_and_leaves_nothing() -> None:
    before = _pids_of_children()
    t0 = time.monotonic()
    with pytest.raises(DistributedError, match=r"rank 1 of 2 failed: ValueError: rank one's own"):
        run_ranks(_fails_on_rank_one, 2, timeout_s=60)
    assert time.monotonic() - t0 < 25  # not the sleeping rank's 30 s
    assert not {p for p in _pids_of_children() - before if _alive(p)}


def _sleeps(_rank: int, _world: int) -> None:
    time.sleep(60)


def test_ranks_past_their_time_are_killed() -> None:
    before = _pids_of_children()
    with pytest.raises(DistributedError, match=r"did not all finish within 2 s"):
        run_ranks(_sleeps, 2, timeout_s=2)
    assert not {p for p in _pids_of_children() - before if _alive(p)}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ["mlp", "transformer_encoder", "causal_decoder", "llama_tiny"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_ddp_rank_estimate_matches_real_ddp(
    one_thread: None, name: str, world: int, precision: str
) -> None:
    # Each rank: DistributedDataParallel(copy of the model) with its defaults, AdamW, batch 3
    # per rank, its third step measured (DDP rebuilds its buckets in the second). The
    # estimate: the plain profile's step plus DDP's buckets. Byte for byte, up to 1 KiB of
    # gloo's own small tensors on the measuring thread, and the flat copy through which DDP
    # broadcasts the buffers at each forward where a gloo thread frees it unseen (see
    # test_ddp_with_batchnorm_buffers; a rotary cache or mask buffer is broadcast too).
    entry = zoo.ZOO[name]
    model = entry.build()
    inputs = entry.make_inputs(3)
    before = snapshot_model(model)
    est = profile_model(model, inputs=inputs, device="cpu").estimate(
        3, precision, "adamw", gpus=world
    )
    real = measure(model, inputs, optimizer="adamw", precision=precision, gpus=world, timeout_s=120)
    assert_model_unchanged(model, before)
    assert (real.gpus, real.strategy, len(real.rank_peak_bytes)) == (world, "ddp", world)
    assert real.peak_bytes == max(real.rank_peak_bytes)
    for peak in real.rank_peak_bytes:
        assert 0 <= peak - est.peak_bytes <= 1024 + est.buffer_bytes, (peak, est.peak_bytes)


def test_ddp_with_batchnorm_buffers(one_thread: None) -> None:
    # ResNet-18 has BatchNorm buffers, which DDP broadcasts from rank 0 at every forward
    # through a flat copy. A gloo worker thread may drop that copy last; the CPU profiler
    # does not see frees there, so a rank can be measured as still holding it: at most the
    # buffers' bytes above the estimate (its running means and variances), never below.
    entry = zoo.ZOO["resnet18"]
    model = entry.build()
    inputs = entry.make_inputs(2)
    est = profile_model(model, inputs=inputs, device="cpu").estimate(2, "fp32", "sgd", gpus=2)
    real = measure(model, inputs, optimizer="sgd", gpus=2, timeout_s=120)
    for peak in real.rank_peak_bytes:
        assert 0 <= peak - est.peak_bytes <= est.buffer_bytes, (peak, est.peak_bytes)


def test_inference_is_not_wrapped() -> None:
    entry = zoo.ZOO["mlp"]
    model, inputs = entry.build(), entry.make_inputs(2)
    real = measure(model, inputs, mode="inference", gpus=2)
    assert real.gpus == 1 and real.rank_peak_bytes == ()
    assert real.peak_bytes == measure(model, inputs, mode="inference").peak_bytes


def _zero_shards(rank: int, world: int) -> list[list[str]]:
    import torch.distributed as dist  # noqa: F401  (the group run_ranks made)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = zoo.ZOO["llama_tiny"].build()
    names = {id(p): n for n, p in model.named_parameters()}
    opt = ZeroRedundancyOptimizer(list(model.parameters()), optimizer_class=torch.optim.AdamW)
    return [[names[id(p)] for p in groups[0]["params"]] for groups in opt._partition_parameters()]


def test_zero_partition_is_zeros_own() -> None:
    # the shards (and their order) ZeroRedundancyOptimizer itself makes, on 3 ranks
    from vram_widget._estimating.options import Precision
    from vram_widget._estimating.sharding import zero_partition

    entry = zoo.ZOO["llama_tiny"]
    profile = profile_model(entry.build(), inputs=entry.make_inputs(2), device="cpu")
    ours = zero_partition(profile._trainable_params(Precision.FP32, profile.levers()), 3)
    theirs = run_ranks(_zero_shards, 3, timeout_s=60)
    assert all(shards == ours for shards in theirs)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", ["mlp", "resnet18", "llama_tiny"])
def test_zero1_every_rank_matches_real_zero(one_thread: None, name: str, world: int) -> None:
    # DDP + ZeroRedundancyOptimizer(AdamW): each rank's estimate (its shard's state and its
    # step, in ZeRO's order) against that rank measured; the default estimate is the worst.
    entry = zoo.ZOO[name]
    model = entry.build()
    inputs = entry.make_inputs(2)
    profile = profile_model(model, inputs=inputs, device="cpu")
    kwargs = {"gpus": world, "strategy": "zero1"}
    real = measure(model, inputs, optimizer="adamw", timeout_s=120, **kwargs)
    ranks = [profile.estimate(2, "fp32", "adamw", rank=r, **kwargs) for r in range(world)]
    for est, peak in zip(ranks, real.rank_peak_bytes, strict=True):
        assert 0 <= peak - est.peak_bytes <= 1024 + est.buffer_bytes, (est.rank, peak)
    worst = profile.estimate(2, "fp32", "adamw", **kwargs)
    assert worst.peak_bytes == max(e.peak_bytes for e in ranks)
    # the shards differ: so do the ranks' states, and they add up to DDP's whole state
    ddp = profile.estimate(2, "fp32", "adamw", gpus=world)
    assert sum(e.optimizer_state_bytes for e in ranks) == ddp.optimizer_state_bytes


@pytest.mark.parametrize(
    "levers",
    [
        {"checkpoint": "auto"},
        {"trainable": ["lm_head.*"]},
        {"grad_accumulation": 2},
        {"lora_rank": 4, "lora_targets": ["q_proj", "v_proj"]},
    ],
    ids=["checkpoint", "frozen", "accumulation", "lora"],
)
@pytest.mark.parametrize("strategy", ["zero1", "zero3"])
def test_strategies_compose_with_the_levers(
    one_thread: None, levers: dict[str, object], strategy: str
) -> None:
    # The levers applied by their libraries inside each rank (HF-style checkpointing is
    # torch's checkpoint_wrapper here, PEFT's LoRA) under DDP + ZeRO-1 and FSDP2, against
    # each rank's estimate from the plain profile. LoRA keeps its known gap, bounded as in
    # test_levers at 32 B per adapter: 4 adapters here (q_proj and v_proj of 2 layers).
    # Under FSDP2 each micro-batch gathers and reduce-scatters again.
    entry = zoo.ZOO["llama_tiny"]
    model = entry.build()
    inputs = entry.make_inputs(2)
    profile = profile_model(model, inputs=inputs, device="cpu")
    kwargs = {"gpus": 2, "strategy": strategy, **levers}
    real = measure(model, inputs, optimizer="adamw", timeout_s=120, **kwargs)
    slack = 32 * 4 if "lora_rank" in levers else 0
    for rank, peak in enumerate(real.rank_peak_bytes):
        est = profile.estimate(2, "fp32", "adamw", rank=rank, **kwargs)
        assert 0 <= peak - est.peak_bytes <= slack + est.buffer_bytes, (rank, peak)


# FSDP2 estimates against real ranks: to the byte (4 B apart where a rank peaked at the
# root's reduce-scatter, before the loss's gradient seed was kept past the final callback:
# docs/known-gaps.md); where that can happen, a byte bound far tighter than the 0.5 %
# target, which a missed buffer (KBs here) cannot slip under
FSDP_SLACK_BYTES = 1024


def test_fsdp2_ranks_against_their_estimate(one_thread: None) -> None:
    # FSDP2's fully_shard on each decoder block and the root (zero2 / zero3) on real gloo
    # ranks: each rank holds its dim-0 shard of the parameters and of AdamW's two states
    # (half of one device's, up to FSDP's padding of dim 0 to the world size), and every
    # rank's measured step is its estimate from the single-device profile
    entry = zoo.ZOO["llama_tiny"]
    model = entry.build()
    inputs = entry.make_inputs(2)
    before = snapshot_model(model)
    single = measure(model, inputs, optimizer="adamw")
    input_bytes = inputs.numel() * inputs.element_size()  # one token tensor
    padding = sum(3 * 4 * (p.numel() // max(p.shape[0], 1)) for p in model.parameters())
    profile = profile_model(model, inputs=inputs, device="cpu")
    for strategy in ("zero2", "zero3"):
        real = measure(model, inputs, optimizer="adamw", gpus=2, strategy=strategy)
        assert (real.gpus, real.strategy, len(real.rank_peak_bytes)) == (2, strategy, 2)
        sharded = (single.resident_bytes - input_bytes) / 2 + input_bytes
        assert abs(real.resident_bytes - sharded) <= padding, (strategy, real.resident_bytes)
        for rank, peak in enumerate(real.rank_peak_bytes):
            est = profile.estimate(2, "fp32", "adamw", gpus=2, strategy=strategy, rank=rank)
            assert est.peak_bytes == peak, (strategy, rank, peak)
    assert_model_unchanged(model, before)


def test_fsdp2_mixed_precision_policy_against_the_estimate(one_thread: None) -> None:
    # amp-bf16 under FSDP2: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), the
    # step on bf16 parameters gathered from fp32 shards, fp32 gradient shards
    entry = zoo.ZOO["llama_tiny"]
    model = entry.build()
    inputs = entry.make_inputs(2)
    profile = profile_model(model, inputs=inputs, device="cpu")
    for strategy in ("zero2", "zero3"):
        real = measure(
            model, inputs, optimizer="adamw", precision="amp-bf16", gpus=2, strategy=strategy
        )
        est = profile.estimate(2, "amp-bf16", "adamw", gpus=2, strategy=strategy)
        assert est.peak_bytes == real.peak_bytes, strategy
        plain = profile.estimate(2, "fp32", "adamw", gpus=2, strategy=strategy)
        assert est.parameter_bytes == plain.parameter_bytes  # the shards stay fp32


@pytest.mark.parametrize("gpus_per_node", [1, 2])
def test_hsdp_ranks_against_their_estimate(one_thread: None, gpus_per_node: int) -> None:
    # HSDP on 4 ranks: a 2-D mesh of 2 nodes x 2 GPUs (sharded in a node, gradient shards
    # all-reduced across nodes), and of 4 nodes x 1 GPU (one shard: copied, not gathered)
    entry = zoo.ZOO["llama_tiny"]
    model = entry.build()
    inputs = entry.make_inputs(2)
    profile = profile_model(model, inputs=inputs, device="cpu")
    real = measure(
        model, inputs, optimizer="adamw", gpus=4, strategy="hsdp", gpus_per_node=gpus_per_node
    )
    zero3 = profile.estimate(2, "fp32", "adamw", gpus=gpus_per_node, strategy="zero3")
    for rank, peak in enumerate(real.rank_peak_bytes):
        est = profile.estimate(
            2, "fp32", "adamw", gpus=4, strategy="hsdp", gpus_per_node=gpus_per_node, rank=rank
        )
        assert est.peak_bytes == peak, (rank, peak, est.peak_bytes)
        # a node's shards: the same parameters per rank as zero3 over one node's GPUs
        assert est.parameter_bytes == (
            zero3.parameter_bytes
            if gpus_per_node > 1
            else profile.estimate(2, "fp32", "adamw").parameter_bytes
        )


def test_fsdp_units_chosen_by_class_and_name(one_thread: None) -> None:
    # units other than the repeated blocks: each decoder layer's attention and MLP (by
    # class name), and one layer by name (the root keeps the rest: warned)
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = hf_llama()
    inputs = hf_tokens(2)
    profile = profile_model(model, inputs=inputs, device="cpu")
    for units in (["LlamaAttention", "LlamaMLP"], "model.layers.1"):
        with pytest.warns(UserWarning, match=r"the root .* holds \d+% of the parameters"):
            est = profile.estimate(2, "fp32", "adamw", gpus=2, strategy="zero3", fsdp_units=units)
        real = measure(model, inputs, optimizer="adamw", gpus=2, strategy="zero3",
                       fsdp_units=units)  # fmt: skip
        # 4 B apart where the peak is the root's reduce-scatter (docs/known-gaps.md)
        assert abs(est.peak_bytes - real.peak_bytes) <= FSDP_SLACK_BYTES, units
    with pytest.raises(ValueError, match="fsdp_units 'Nope' matches no module"):
        measure(model, inputs, gpus=2, strategy="zero3", fsdp_units="Nope")


def test_fsdp2_composes_with_the_sequence_axis(one_thread: None) -> None:
    # zero3 at 40 tokens from a profile of 16: the length fit and FSDP2's edits together,
    # against real gloo ranks at 40 tokens
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = hf_llama()
    profile = profile_model(model, inputs=hf_tokens(2), device="cpu")
    real = measure(model, hf_tokens(3, 40, seed=1), optimizer="adamw", gpus=2, strategy="zero3")
    with pytest.warns(UserWarning, match="the root .* holds 63%"):  # a 1,000-word vocabulary
        est = profile.estimate(3, "fp32", "adamw", seq_len=40, gpus=2, strategy="zero3")
    assert est.peak_bytes == real.peak_bytes


def test_zero1_ranks_run_the_asked_implementation(one_thread: None) -> None:
    # measure(recipe=...) with ZeroRedundancyOptimizer: each rank's local AdamW is built as
    # the recipe's implementation asks (foreach=True / False), as the estimate's trace is:
    # the two implementations' rank peaks differ, and each rank's estimate follows its own
    from vram_widget import Recipe

    entry = zoo.ZOO["mlp"]
    model = entry.build()
    inputs = entry.make_inputs(2)
    profile = profile_model(model, inputs=inputs, device="cpu")
    measured = {}
    for impl in ("foreach", "forloop"):
        recipe = Recipe.from_keywords(
            batch_size=2, optimizer=f"adamw-{impl}", gpus=2, strategy="zero1"
        )
        real = measure(model, inputs, recipe=recipe, timeout_s=120)
        ranks = [profile.estimate(recipe=recipe.with_(rank=r)) for r in range(2)]
        for est, peak in zip(ranks, real.rank_peak_bytes, strict=True):
            assert 0 <= peak - est.peak_bytes <= 1024 + est.buffer_bytes, (impl, est.rank, peak)
        measured[impl] = real.rank_peak_bytes
    # were the implementation dropped, both runs would be the same step
    assert measured["foreach"] != measured["forloop"]
