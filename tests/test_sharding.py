"""The data-parallel strategies' rules (``sharding``) and ``estimate(gpus=, strategy=)``.

The rules are checked here by hand and against torch's own bucketing function; against real
torch.distributed runs in ``test_distributed.py``.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from vram_widget import Category, profile_model, zoo
from vram_widget._display.figures import floor_categories, waterfall_data
from vram_widget._estimating.levers import Levers
from vram_widget._estimating.options import CATEGORY_CODE, PHASE_CODE, Mode, Phase, Precision
from vram_widget._estimating.sharding import (
    DDP_BUCKET_CAP_BYTES,
    DDP_FIRST_BUCKET_CAP_BYTES,
    FsdpParam,
    StepEdits,
    TrainableParam,
    ddp_bucket_bytes,
    fsdp_step_edits,
    local_shard_shape,
    resolve_fsdp_units,
    resolve_parallel,
)

MIB = 2**20


def test_ddp_buckets_by_hand() -> None:
    # Registration order a (30 MiB), b (2 MiB), c (0.5 MiB), d (0.5 MiB), all fp32. DDP
    # fills buckets in reverse: d + c = 1 MiB reaches the 1 MiB first bucket's limit and
    # closes it; b (2 MiB) then a (30 MiB) make 32 MiB >= 25 MiB, the second bucket.
    ps = [
        TrainableParam("a", 30 * MIB // 4, "float32"),
        TrainableParam("b", 2 * MIB // 4, "float32"),
        TrainableParam("c", MIB // 8, "float32"),
        TrainableParam("d", MIB // 8, "float32"),
    ]
    assert ddp_bucket_bytes(ps) == [1 * MIB, 32 * MIB]
    # dtypes never share a bucket: the fp32 adapters of a bf16 base get buckets of their own
    mixed = [TrainableParam("w", 3 * MIB // 2, "bfloat16"), TrainableParam("lora", 1024, "float32")]
    assert sorted(ddp_bucket_bytes(mixed)) == [4096, 3 * MIB]
    assert ddp_bucket_bytes([]) == []


def test_ddp_buckets_match_torch_bucketing() -> None:
    # torch's own assignment (the reducer's compute_bucket_assignment_by_size, which DDP
    # calls with [1 MiB, 25 MiB] when it rebuilds its buckets) on tensors in the reverse of
    # their registration order, as our rule assumes the gradients become ready.
    import torch.distributed as dist

    rng = random.Random(0)
    for _ in range(20):
        sizes = [rng.choice([1, 7, 512, 4096, 65536, 2**18, 2**21, 7 * 2**20]) for _ in range(12)]
        tensors = [torch.empty(n, dtype=torch.float32) for n in sizes]
        indices, _limits = dist._compute_bucket_assignment_by_size(
            list(reversed(tensors)),
            [DDP_FIRST_BUCKET_CAP_BYTES, DDP_BUCKET_CAP_BYTES],
            [False] * len(tensors),
        )
        theirs = sorted(sum(4 * sizes[len(sizes) - 1 - i] for i in bucket) for bucket in indices)
        ours = ddp_bucket_bytes([TrainableParam(str(i), n, "float32") for i, n in enumerate(sizes)])
        assert sorted(ours) == theirs


@pytest.mark.parametrize(
    ("gpus", "strategy", "message"),
    [
        (0, "ddp", r"gpus must be an int >= 1 .* got 0"),
        (1.5, "ddp", r"gpus must be an int >= 1 .* got 1\.5"),
        (True, "ddp", r"gpus must be an int >= 1 .* got True"),
        ("2", "ddp", r"gpus must be an int >= 1 .* got '2'"),
        (2, "zero4", r"zero4.*ddp.*zero1.*zero2.*zero3.*hsdp"),
    ],
)
def test_bad_parallel_settings_name_the_problem(gpus: object, strategy: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_parallel(gpus, strategy)
    profile = profile_model(nn.Linear(8, 8), input_size=(8,), device="cpu")
    with pytest.raises(ValueError, match=message):
        profile.estimate(2, gpus=gpus, strategy=strategy)


def test_ddp_rank_holds_the_trainable_bytes_once_more() -> None:
    # Linear(1024, 1024): 1,048,576 + 1,024 = 1,049,600 parameters. Under DDP each rank holds
    # a bucket copy of the gradients: fp32 4 x 1,049,600 = 4,198,400 B, resident all step;
    # bf16 2 x 1,049,600 = 2,099,200 B.
    profile = profile_model(nn.Linear(1024, 1024), input_size=(1024,), device="cpu")
    for precision, bucket_bytes in (
        ("fp32", 4_198_400),
        ("bf16", 2_099_200),
        ("amp-bf16", 4_198_400),
    ):
        one = profile.estimate(8, precision, "adamw")
        ranks = profile.estimate(8, precision, "adamw", gpus=4)
        assert ranks.communication_bytes == bucket_bytes
        assert ranks.peak_bytes - one.peak_bytes == bucket_bytes
        assert ranks.peak_breakdown[Category.COMMUNICATION] == bucket_bytes
        assert (ranks.gpus, ranks.strategy, one.gpus, one.strategy) == (4, "ddp", 1, None)
        # everything else is the single-device step at the per-rank batch
        assert ranks.activation_bytes == one.activation_bytes
        assert ranks.flops == one.flops
    # one device: no wrapper whatever the strategy; inference: no wrapper
    plain = profile.estimate(8, "fp32", "adamw")
    assert profile.estimate(8, "fp32", "adamw", gpus=1).peak_bytes == plain.peak_bytes
    inference = profile.estimate(8, mode="inference", gpus=8)
    assert inference.communication_bytes == 0 and inference.gpus == 1


def test_ddp_buckets_follow_the_levers() -> None:
    # A frozen backbone: only the head's gradients are bucketed. zoo.mlp's last Linear is
    # named "6" (512 -> 10): 5,130 parameters, 20,520 B in fp32.
    profile = profile_model(zoo.mlp(), input_size=(784,), device="cpu")
    est = profile.estimate(4, "fp32", "adamw", gpus=2, trainable="6.*")
    assert est.communication_bytes == 4 * (512 * 10 + 10)


def test_waterfall_floor_shows_the_buckets() -> None:
    profile = profile_model(zoo.mlp(), input_size=(784,), device="cpu")
    one, ranks = profile.estimate(4), profile.estimate(4, gpus=2)
    assert Category.COMMUNICATION not in floor_categories(one)
    assert floor_categories(ranks)[-1] is Category.COMMUNICATION
    data = waterfall_data(ranks, 1)
    assert data.floor_bytes[-1] == ranks.communication_bytes
    assert data.run_max_bytes.max() == ranks.peak_bytes  # the bars still reach the peak


def test_zero1_ranks_hold_their_shard_of_the_optimizer_state() -> None:
    # Linear(64, 64) then Linear(64, 32): 0.weight 4,096, 0.bias 64, 1.weight 2,048,
    # 1.bias 32 elements. ZeRO's partition on 2 ranks, largest first to the emptier rank:
    # 0.weight -> rank 0; 1.weight -> rank 1 (0 < 4,096); 0.bias -> rank 1 (2,048 < 4,096);
    # 1.bias -> rank 1 (2,112 < 4,096). SGD with momentum keeps one buffer per parameter:
    # rank 0 4 x 4,096 = 16,384 B, rank 1 4 x (2,048 + 64 + 32) = 8,576 B. Both keep DDP's
    # buckets, 4 x 6,240 = 24,960 B.
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 32))
    profile = profile_model(model, input_size=(64,), device="cpu")
    kwargs = {"optimizer": "sgd-momentum", "gpus": 2, "strategy": "zero1"}
    zero = [profile.estimate(4, rank=r, **kwargs) for r in (0, 1)]
    assert [e.optimizer_state_bytes for e in zero] == [16_384, 8_576]
    assert [e.rank for e in zero] == [0, 1]
    assert all(e.communication_bytes == 24_960 for e in zero)
    ddp = profile.estimate(4, optimizer="sgd-momentum", gpus=2)
    assert ddp.optimizer_state_bytes == 24_960  # every parameter's buffer
    # the worst rank by default: rank 0 (more state, the largest step temporary)
    worst = profile.estimate(4, **kwargs)
    assert worst.rank == 0 and worst.peak_bytes == max(e.peak_bytes for e in zero)
    assert zero[0].peak_bytes - zero[1].peak_bytes >= 16_384 - 8_576
    with pytest.raises(
        ValueError, match=r"rank must be None \(the worst rank\) or an int in \[0, 2\)"
    ):
        profile.estimate(4, rank=2, **kwargs)


def _tiny_fsdp(gloo: bool, reshard_after_forward: bool = True, averaged: bool = False) -> StepEdits:
    # rows: 0 the root, 1 'emb' (root unit), 2 'b' (block unit 1), 3 (loss), 4 (optimizer)
    # events: forward emb, b, b, loss | backward (from 4) loss, b, b (b's grad), emb (emb's
    # grad) | optimizer at 8
    params = [
        FsdpParam("emb.weight", (5, 2), 4, 1, 0, True),  # 3 of 5 rows per rank: 24 B shard
        FsdpParam("b.weight", (3,), 4, 2, 1, True),  # 2 of 3 per rank: 8 B shard
    ]
    return fsdp_step_edits(
        params,
        [0, 2],
        np.asarray([0, 0, 1, 0, 0]),
        world_size=2,
        reshard_after_forward=reshard_after_forward,
        gloo=gloo,
        event_module=np.asarray([1, 2, 2, 3, 3, 2, 2, 1]),
        loss_row=3,
        micro_batches=[(0, 4, 8)],
        optimizer_at=8,
        gradient_allocs=[(10, 12, 2, 6), (11, 40, 1, 7)],  # whole gradients: 3 x 4, 5 x 2 x 4
        n_rows=5,
        averaged=averaged,
    )


def test_fsdp_step_edits_by_hand() -> None:
    edits = _tiny_fsdp(gloo=False)
    # flat all-gather outputs: root 2 ranks x 24 = 48, block 2 x 8 = 16; the copied-out
    # parameters as large; reduce-scatter inputs as large, outputs one shard (24, 8)
    assert list(zip(edits.position.tolist(), edits.nbytes.tolist(), strict=True)) == [
        (0, 48), (0, 48),  # root: gather, copy out (kept to the backward)
        (1, 16), (1, 16), (1, -48),  # block: gather, copy out, then the root's flat freed
        (3, -16),  # block's post_forward reshards (zero3)
        (3, -16),  # the root's post_forward frees the last flat output
        (5, 16),  # root's pre_backward prefetches the block (after the loss's backward)
        (5, 16), (5, -16),  # block's pre_backward: copy out, flat freed at once
        # post_backward: reshard, RS in, RS out, and only then the gradient of the unit's
        # last parameter (foreach_reduce's loop variable holds it until it returns)
        (7, -16), (7, 16), (7, 8), (7, -12),
        # final callback (root): reshard, drop the block's RS input, RS in, RS out, its
        # last (only) gradient freed, and at the end of the backward the RS input dropped
        (8, -48), (8, -16), (8, 48), (8, 24), (8, -40), (8, -48),
        # zero_grad, after the optimizer: the block's, then the root's gradient shards
        (8, -8), (8, -24),
    ]  # fmt: skip
    assert edits.phase[-2:].tolist() == [PHASE_CODE[Phase.ZERO_GRAD]] * 2
    # every new storage is allocated once and freed once (the gradient shards, the
    # reduce-scatter outputs, at zero_grad); the gradients freed are the two
    new = edits.storage[edits.storage < 0].tolist()
    assert all(new.count(sid) == 2 for sid in set(new))
    assert edits.freed_gradients == {10, 11}
    assert int(edits.nbytes.sum()) == -12 - 40  # all freed, the whole gradients early
    assert edits.param_rows.tolist() == [0, 24, 8, 0, 0] == edits.grad_rows.tolist()
    assert edits.param_blocks.tolist() == [24, 8]


def test_fsdp_shard_of_one_rank_by_hand() -> None:
    # _tiny_fsdp's step on a shard of one rank (hsdp with one GPU a node), the root's
    # gradient recorded whole (80 B: a tensor-parallel Replicate gradient of a weight whose
    # local shard is 5 x 2 x 4 B = 40 B) and the gradient seed (4 B, made on the loss row at
    # the backward's start) freed by the timeline at event 7
    params = [
        FsdpParam("emb.weight", (5, 2), 4, 1, 0, True),
        FsdpParam("b.weight", (3,), 4, 2, 1, True),
    ]
    step = {
        "world_size": 1, "reshard_after_forward": True, "gloo": True,
        "event_module": np.asarray([1, 2, 2, 3, 3, 2, 2, 1]), "loss_row": 3,
        "micro_batches": [(0, 4, 8)], "optimizer_at": 8,
        "gradient_allocs": [(10, 12, 2, 6), (11, 80, 1, 7)], "n_rows": 5,
        "seed_frees": [(12, 4, 3, 7)],
    }  # fmt: skip
    edits = fsdp_step_edits(params, [0, 2], np.asarray([0, 0, 1, 0, 0]), **step)  # type: ignore[arg-type]
    events = list(zip(edits.position.tolist(), edits.nbytes.tolist(), strict=True))
    assert events == [
        (0, 40), (1, 12), (3, -12),  # copied out, not gathered (nor staged on gloo)
        (5, 12),  # the block copied out again for its backward
        # post_backward: reshard, the copy's input, the gradient freed at the copy-in (no
        # loop variable holds it with one rank), the output
        (7, -12), (7, 12), (7, -12), (7, 12),
        (8, 4),  # the seed's free at event 7 undone
        # final callback: the root's rows cloned from the whole gradient, which goes;
        # reshard, the block's input dropped, the root's input, clone freed, output
        (8, 40), (8, -80), (8, -40), (8, -12), (8, 40), (8, -40), (8, 40),
        (8, -40), (8, -4),  # the root's input dropped, then the seed as backward() returns
        (8, -12), (8, -40),  # zero_grad: the gradient shards
    ]  # fmt: skip
    assert edits.freed_gradients == {10, 11}
    assert int(edits.nbytes.sum()) == -12 - 80  # all freed, the whole gradients early
    assert edits.param_rows.tolist() == [0, 40, 12, 0, 0] == edits.grad_rows.tolist()
    # across replicas (hsdp over nodes), averaged on gloo: the all-reduce's wrapped divisor
    # and its fp32 cast, 8 + 4 = 12 B, right after each unit's reduce output; nothing else
    averaged = fsdp_step_edits(
        params,
        [0, 2],
        np.asarray([0, 0, 1, 0, 0]),
        averaged=True,
        replicated=True,
        **step,  # type: ignore[arg-type]
    )
    pairs = list(zip(averaged.position.tolist(), averaged.nbytes.tolist(), strict=True))
    assert pairs == [*events[:8], (7, 12), (7, -12), *events[8:16], (8, 12), (8, -12), *events[16:]]


def test_fsdp_zero2_keeps_blocks_and_gloo_stages_collectives() -> None:
    zero2 = _tiny_fsdp(gloo=False, reshard_after_forward=False)
    # no reshard after the block's forward and no gather in its backward: 3 events fewer
    assert len(zero2.nbytes) == len(_tiny_fsdp(gloo=False).nbytes) - 4
    assert (5, 16) not in list(zip(zero2.position.tolist(), zero2.nbytes.tolist(), strict=True))
    gloo = _tiny_fsdp(gloo=True)
    # two flat temporaries per all-gather (3 gathers), one per reduce-scatter (2): +x, -x each
    assert len(gloo.nbytes) == len(_tiny_fsdp(gloo=False).nbytes) + 2 * (2 * 3 + 2)
    assert int(gloo.nbytes.sum()) == int(_tiny_fsdp(gloo=False).nbytes.sum())


def _staged(edits: StepEdits) -> tuple[list[int], list[int]]:
    """The backward's communication buffers kept past their event (the reduce-scatter
    inputs) and its temporaries (allocated, then freed at once: gloo's staging copies)."""
    n, sid = edits.nbytes, edits.storage
    backward = edits.phase == PHASE_CODE[Phase.BACKWARD]
    comm = edits.category == CATEGORY_CODE[Category.COMMUNICATION]
    made = np.nonzero(backward & comm & (n > 0))[0]
    at_once = [i for i in made if i + 1 < len(n) and sid[i + 1] == sid[i] and n[i + 1] == -n[i]]
    kept = [int(n[i]) for i in made if i not in at_once]
    return kept, [int(n[i]) for i in at_once]


def test_gloo_averages_each_reduce_scatter_beside_its_copy() -> None:
    # ReduceOp.AVG on gloo: the staging copy of each reduce-scatter's input (block 2 x 8 =
    # 16 B, root 2 x 24 = 48 B), then an 8 B wrapped divisor and its 4 B fp32 cast beside
    # it: 16 + 12 = 28, 48 + 12 = 60. Kept: the block's prefetched gather (16) and the two
    # reduce-scatter inputs; the prefetch's two staging copies (16 each) are unchanged
    assert _staged(_tiny_fsdp(gloo=True)) == ([16, 16, 48], [16, 16, 16, 48])
    assert _staged(_tiny_fsdp(gloo=True, averaged=True)) == ([16, 16, 48], [16, 16, 28, 60])
    # NCCL averages in place: nothing staged, averaged or not
    assert _staged(_tiny_fsdp(gloo=False, averaged=True)) == ([16, 16, 48], [])
    assert _tiny_fsdp(gloo=False, averaged=True).nbytes.tolist() == (
        _tiny_fsdp(gloo=False).nbytes.tolist()
    )


def test_the_average_is_gloos_and_fp32_bf16_only() -> None:
    # FSDP2 reduce-scatters bf16 gradients with ReduceOp.AVG: on the CPU profile (gloo) the
    # root's staging copy carries gloo_average_bytes(2) = 8 + 2 B beside the reduce-scatter
    # input's size; fp16 gradients are summed (FSDP2 divides them itself,
    # _get_gradient_divide_factors): the bare copy; a CUDA profile (NCCL) stages nothing
    def staging(device: str, precision: Precision) -> tuple[list[int], list[int]]:
        profile = profile_model(zoo.mlp(hidden=(8,)), input_size=(784,), device=device)
        timeline = profile.timeline(precision, Mode.TRAIN)
        parallel = resolve_parallel(2, "zero2")  # one unit, the root: no warning
        return _staged(profile._fsdp_edits(timeline, precision, Levers(), parallel))

    # the root, the MLP's only unit, reduce-scatters once
    ([bf16_input], [bf16_copy]) = staging("cpu", Precision.BF16)
    assert bf16_copy == bf16_input + 8 + 2
    ([fp16_input], [fp16_copy]) = staging("cpu", Precision.FP16)
    assert fp16_copy == fp16_input == bf16_input
    assert staging("cuda", Precision.BF16) == ([bf16_input], [])


def test_local_shards_and_the_fsdp_shards_in_an_estimate() -> None:
    assert [local_shard_shape((5, 3), 4, r) for r in range(4)] == [(2, 3), (2, 3), (1, 3), (0, 3)]
    profile = profile_model(zoo.mlp(hidden=(8,)), input_size=(784,), device="cpu")
    one = profile.estimate(4, "fp32", "adam")
    # an MLP has no repeated blocks: its only unit is the root, gathered whole
    with pytest.warns(UserWarning, match=r"zero3: the root .* holds 100% of the parameters"):
        two = profile.estimate(4, "fp32", "adam", gpus=2, strategy="zero3")
    assert two.parameter_bytes < one.parameter_bytes and two.strategy == "zero3"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"gpus": 12, "gpus_per_node": 8},
            r"gpus=12 is not a whole number of nodes of gpus_per_node=8",
        ),
        ({"gpus": 4, "gpus_per_node": 0}, r"gpus_per_node must be an int >= 1; got 0"),
        ({"gpus": 4, "gpus_per_node": "8"}, r"gpus_per_node must be an int >= 1; got '8'"),
    ],
)
def test_bad_hsdp_settings_name_the_problem(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_parallel(strategy="hsdp", **kwargs)  # type: ignore[arg-type]


def test_hsdp_shards_within_a_node() -> None:
    # 16 GPUs in nodes of 8: a parameter is sharded 8 ways; 4 GPUs (part of one node): 4 ways
    assert resolve_parallel(16, "hsdp", gpus_per_node=8).shard_ranks == 8
    assert resolve_parallel(4, "hsdp").shard_ranks == 4
    assert resolve_parallel(16, "zero3", gpus_per_node=8).shard_ranks == 16


def test_fsdp_units_name_what_they_match() -> None:
    names = ("", "h", "h.0", "h.1", "h.0.fc", "head")
    types = ("M", "ModuleList", "B", "B", "Linear", "Linear")
    assert resolve_fsdp_units(names, types, "Linear") == ("h.0.fc", "head")
    assert resolve_fsdp_units(names, types, ["B", "h.0.fc"]) == ("h.0", "h.1")  # outermost
    with pytest.raises(ValueError, match=r"'Conv2d' matches no module .* names such as 'h'"):
        resolve_fsdp_units(names, types, "Conv2d")
    with pytest.raises(ValueError, match=r"a module name or class name, or a list of them"):
        resolve_fsdp_units(names, types, [3])
    profile = profile_model(zoo.mlp(hidden=(8,)), input_size=(784,), device="cpu")
    with pytest.raises(ValueError, match="fsdp_units 'Conv2d' matches no module"):
        profile.estimate(2, gpus=2, strategy="zero3", fsdp_units="Conv2d")


def test_fsdp_mixed_precision_policy_by_hand() -> None:
    # MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) on the fp32 shards of
    # _tiny_fsdp: emb's shard is 3 x 2 = 6 elements, b's 2
    params = [
        FsdpParam("emb.weight", (5, 2), 4, 1, 0, True, gather_itemsize=2, reduce_itemsize=4),
        FsdpParam("b.weight", (3,), 4, 2, 1, True, gather_itemsize=2, reduce_itemsize=4),
    ]
    edits = fsdp_step_edits(
        params, [0, 2], np.asarray([0, 0, 1, 0, 0]), world_size=2, reshard_after_forward=True,
        gloo=False, event_module=np.asarray([1, 2, 2, 3, 3, 2, 2, 1]), loss_row=3,
        micro_batches=[(0, 4, 8)], optimizer_at=8, gradient_allocs=[(10, 6, 2, 6), (11, 20, 1, 7)],
        n_rows=5,
    )  # fmt: skip
    events = list(zip(edits.position.tolist(), edits.nbytes.tolist(), strict=True))
    # root: 6 x 2 B cast into one bf16 buffer, 2 x 12 B gathered, the cast freed, copied out
    assert events[:4] == [(0, 12), (0, 24), (0, -12), (0, 24)]
    # the block's post_backward: reshard (2 x 2 x 2 B), reduce-scatter input 2 x 2 x 4 B
    # (fp32), output 2 x 4 B, then its bf16 gradient (3 x 2 B) freed
    assert events[events.index((7, -8)) :][:4] == [(7, -8), (7, 16), (7, 8), (7, -6)]
    assert edits.param_rows.tolist() == [0, 24, 8, 0, 0]  # fp32 shards
    assert edits.grad_rows.tolist() == [0, 24, 8, 0, 0]  # fp32 gradient shards


@pytest.mark.parametrize(
    "levers", [{}, {"grad_accumulation": 2}, {"trainable": ["lm_head.*"]}, {"checkpoint": "auto"}]
)
def test_fsdp_step_gives_everything_back(levers: dict[str, object]) -> None:
    # Invariant of the edited step: live bytes never dip below what is resident, and the
    # step ends where it began (the gradient shards go at zero_grad, whole gradients once),
    # so the allocator replay pairs every allocation with one free
    entry = zoo.ZOO["llama_tiny"]
    profile = profile_model(entry.build(), inputs=entry.make_inputs(2))
    for strategy in ("zero2", "zero3", "hsdp"):
        est = profile.estimate(2, "fp32", "adamw", gpus=4, strategy=strategy, **levers)
        resident = est.parameter_bytes + est.buffer_bytes + est.optimizer_state_bytes
        resident += est.input_bytes
        live = est.live_bytes.astype(np.int64)
        assert int(live.min()) >= resident and int(live[-1]) == resident, strategy
        assert est.device_bytes >= est.peak_bytes  # the replay runs


def test_min_gpus_counts_whole_nodes_under_hsdp() -> None:
    # hsdp shards within a node: past one node a rank's memory stays, so a card one node
    # cannot fit is never fitted; the search tries only whole nodes (3 GPUs would be refused)
    entry = zoo.ZOO["llama_tiny"]
    profile = profile_model(entry.build(), inputs=entry.make_inputs(2))
    two = profile.estimate(8, "fp32", "adam", gpus=2, strategy="zero3").device_bytes
    one = profile.estimate(8, "fp32", "adam").device_bytes
    assert two is not None and one is not None and two < one
    assert profile.min_gpus(two, 8, strategy="hsdp", gpus_per_node=2) == 2
    assert profile.min_gpus(two - 2**21, 8, strategy="hsdp", gpus_per_node=2) is None
    assert profile.min_gpus(two, 8, strategy="zero3") == 2
    # nodes of 3: the doubling search's 4 GPUs are 2 whole nodes (6), sharded 3 ways
    three = profile.estimate(8, "fp32", "adam", gpus=3, strategy="zero3").total_bytes
    assert three < profile.estimate(8, "fp32", "adam", gpus=2, strategy="zero3").total_bytes
    found = profile.min_gpus(three, 8, strategy="hsdp", gpus_per_node=3, basis="allocated")
    assert found == 3
