"""The bytes a rank sends per step: the ring counts of each collective, hand-worked; the
collectives a tensor-parallel rank and each pipeline stage issue, recorded on the fake
process group, against those the real gloo process group runs."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from models import hf_llama, hf_mixtral, hf_tokens, routed_experts

from vram_widget import profile_model
from vram_widget._estimating.communication import (
    Collective,
    CollectiveKind,
    data_parallel_volume,
    sent_bytes,
    volume_of,
)
from vram_widget._estimating.options import Strategy

pytestmark = pytest.mark.timeout(300)

K = CollectiveKind


def test_ring_counts_by_hand() -> None:
    # all-reduce of 1,000 B over 4 ranks: 2 x 3/4 x 1,000 = 1,500; all-gather of a gathered
    # 1,000 B: 3/4 x 1,000 = 750; reduce-scatter alike; all-to-all of 1,000 B keeping 250:
    # 750; a send: all of it; a receive: nothing; 1 rank: nothing moves
    assert sent_bytes(K.ALL_REDUCE, 1_000, 4) == 1_500
    assert sent_bytes(K.ALL_GATHER, 1_000, 4) == 750
    assert sent_bytes(K.REDUCE_SCATTER, 1_000, 4) == 750
    assert sent_bytes(K.ALL_TO_ALL, 1_000, 4, own_bytes=250) == 750
    assert sent_bytes(K.SEND, 1_000, 2) == 1_000
    assert sent_bytes(K.RECV, 1_000, 2) == 0
    assert sent_bytes(K.ALL_REDUCE, 1_000, 1) == 0
    # 3 ranks: 2 x 2/3 x 100 = 133.3 -> 133 (rounded down per collective)
    assert sent_bytes(K.ALL_REDUCE, 100, 3) == 133
    with pytest.raises(ValueError, match="group_size >= 1"):
        sent_bytes(K.ALL_REDUCE, 100, 0)
    volume = volume_of(
        [Collective(K.ALL_REDUCE, 1_000, 4), Collective(K.RECV, 10, 4), Collective(K.SEND, 10, 4)]
    )
    assert volume.sent_bytes == 1_510 and volume.collective_count == 3
    assert dict(volume.sent_bytes_by_kind) == {K.ALL_REDUCE: 1_500, K.SEND: 10}


def test_data_parallel_volume_by_hand() -> None:
    # P = 1,200 B of parameters, G = 800 B of gradients (a frozen part), 4 ranks:
    # ddp: all-reduce G: 2 x 3/4 x 800 = 1,200
    # zero1: + the updated shards, 3/4 x 800 = 600: 1,800
    # zero2: all-gather P once + reduce-scatter G: 3/4 x (1,200 + 800) = 1,500
    # zero3: P twice: 3/4 x (2,400 + 800) = 2,400
    # hsdp, 2 per node (2 nodes): zero3 within a node, 1/2 x 3,200 = 1,600, then the node's
    # gradient shard 800 / 2 = 400 all-reduced over 2 nodes: 2 x 1/2 x 400 = 400: 2,000
    P, G = 1_200, 800
    got = {s: data_parallel_volume(s, 4, P, G, gpus_per_node=2).sent_bytes for s in Strategy}
    assert got == {
        Strategy.DDP: 1_200,
        Strategy.ZERO1: 1_800,
        Strategy.ZERO2: 1_500,
        Strategy.ZERO3: 2_400,
        Strategy.HSDP: 2_000,
    }
    assert data_parallel_volume(None, 1, P, G, 8).sent_bytes == 0
    # zero3 gathering bf16 copies of fp32 weights, 600 B: 3/4 x (2 x 600 + 800) = 1,500
    assert data_parallel_volume(Strategy.ZERO3, 4, P, G, 8, gather_bytes=600).sent_bytes == 1_500


def test_rowwise_linear_all_reduces_its_output(one_thread: None) -> None:
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 24))
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    profile = profile_model(model, inputs=torch.randn(4, 32), device="cpu")
    est = profile.estimate(6, optimizer="sgd", gpus=2, tp=2, tp_plan=plan)
    # the one collective of the step: the rowwise Linear's partial sums all-reduced in the
    # forward, batch 6 x 24 outputs x 4 B = 576 B over 2 ranks: 2 x 1/2 x 576 = 576 B sent.
    # (The colwise Linear's input needs no gradient: no all-reduce in the backward.)
    assert dict(est.communication_sent_bytes_by_kind) == {K.ALL_REDUCE: 576}
    assert est.communication_sent_bytes == 576
    inference = profile.estimate(6, mode="inference", gpus=2, tp=2, tp_plan=plan)
    assert inference.communication_sent_bytes == 576
    assert profile.estimate(6).communication_sent_bytes is None  # one device


def test_a_rank_sends_what_its_step_sends_at_the_asked_length(one_thread: None) -> None:
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 32), nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 24))
    plan = {"1": ColwiseParallel(), "3": RowwiseParallel()}
    profile = profile_model(
        model, inputs=torch.randint(0, 50, (4, 8)), loss_fn=lambda out: out.mean(), device="cpu"
    )
    # batch 6 of 8 tokens: the rowwise Linear's output all-reduced in the forward, 6 x 8 x 24
    # x 4 B = 4,608 B, and the colwise Linear's input gradient in the backward (the
    # embedding trains), 6 x 8 x 32 x 4 B = 6,144 B; over 2 ranks each all-reduce sends its
    # size (2 x 1/2): 10,752 B
    at_8 = profile.estimate(6, optimizer="sgd", gpus=2, tp=2, tp_plan=plan)
    assert dict(at_8.communication_sent_bytes_by_kind) == {K.ALL_REDUCE: 10_752}
    # 16 tokens: both payloads double, 21,504 B (the optimizer's trace asks for the step at
    # the example's 8 tokens after the estimate's own step: not the one sent)
    at_16 = profile.estimate(6, optimizer="sgd", gpus=2, tp=2, tp_plan=plan, seq_len=16)
    assert dict(at_16.communication_sent_bytes_by_kind) == {K.ALL_REDUCE: 21_504}


# The real side: the collectives gloo itself runs, from the profiler's record of its ops
# (``gloo:all_reduce``, ``gloo:all_gather``, ``gloo:send``...: ProcessGroupGloo's
# RECORD_FUNCTION with its input tensors), not from the package's recording.
_GLOO_KINDS = {
    "gloo:all_reduce": K.ALL_REDUCE,
    "gloo:all_gather": K.ALL_GATHER,
    "gloo:reduce_scatter": K.REDUCE_SCATTER,
    "gloo:all_to_all": K.ALL_TO_ALL,
    "gloo:broadcast": K.BROADCAST,
    "gloo:send": K.SEND,
    "gloo:recv": K.RECV,
}
_ITEM_BYTES = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8}


def _gloo_collectives(step: Callable[[], None], world: int) -> list[tuple[str, int, int]]:
    """(kind, payload bytes, bytes the rank keeps) of each collective gloo runs in
    ``step``, in order. The 1-byte all-reduce that the measuring harness queues behind each
    collective (``distributed._fence``) is left out; an all-gather's payload is its gathered
    output, ``world`` times the rank's input. An all-to-all keeps the rows of its input split
    for this rank, which gloo's record does not carry: they are read from the
    ``c10d::alltoall_base_`` call that issued it (the same one in time order; its arguments
    are (output, input, group, output_split_sizes, input_split_sizes, ...), an empty split
    list being an even split); the other kinds keep nothing."""
    import torch.distributed as dist

    rank = dist.get_rank()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True
    ) as prof:
        step()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        os.unlink(path)
    by_time = sorted(trace["traceEvents"], key=lambda e: e.get("ts", 0))
    issued = [e for e in by_time if e.get("name") == "c10d::alltoall_base_"]
    gloo_a2a = [e for e in by_time if e.get("name") == "gloo:all_to_all"]
    assert len(issued) == len(gloo_a2a)
    kept_rows = {}
    for gloo, call in zip(gloo_a2a, issued, strict=True):
        rows = call["args"]["Input Dims"][1][0]
        splits = json.loads(call["args"]["Concrete Inputs"][4])
        kept_rows[id(gloo)] = (splits[rank] if splits else rows // world, rows)
    out = []
    events = sorted(trace["traceEvents"], key=lambda e: e.get("args", {}).get("Ev Idx", 0))
    for e in events:
        kind = _GLOO_KINDS.get(e.get("name", ""))
        if kind is None:
            continue
        args = e["args"]
        dims, dtype = args["Input Dims"][0], args["Input type"][0]
        if dtype == "unsigned char" and dims == [1]:
            continue  # the harness's fence
        numel = 1
        for d in dims:
            numel *= d
        payload = numel * _ITEM_BYTES[dtype]
        own = 0
        if kind is K.ALL_TO_ALL:
            kept, rows = kept_rows[id(e)]
            own = payload * kept // rows
        out.append((kind.value, payload * world if kind is K.ALL_GATHER else payload, own))
    return out


def _sent_by_kind(collectives: list[tuple[str, int, int]], world: int) -> dict[CollectiveKind, int]:
    records = [Collective(K(kind), payload, world, own) for kind, payload, own in collectives]
    return dict(volume_of(records).sent_bytes_by_kind)


def test_tensor_parallel_collectives_match_gloo(one_thread: None) -> None:
    pytest.importorskip("transformers")
    from vram_widget._profiling.distributed import run_ranks
    from vram_widget._profiling.tensor_parallel import rank_setup, resolve_plan

    torch.manual_seed(0)
    model, inputs = hf_llama(), hf_tokens(4)
    est = profile_model(model, inputs=inputs, device="cpu").estimate(
        4, optimizer="adamw", gpus=2, tp=2
    )
    setup = rank_setup(resolve_plan(model, 2), 2)

    def rank_step(_rank: int, world: int) -> list[tuple[str, int, int]]:
        sharded = setup.wrap_model(model, None, None)  # type: ignore[arg-type]
        step = _adamw_step(sharded, inputs)

        step()  # the optimizer's state made
        return _gloo_collectives(step, world)

    ranks = run_ranks(rank_step, 2, timeout_s=120)
    assert ranks[0] == ranks[1]
    # Llama's plan (fp32, batch 4 x 16 tokens, hidden 64, vocab 1,000): each all-reduce is
    # a hidden state of 4 x 16 x 64 x 4 B = 16,384 B (2 x 1/2 of it sent); the output
    # head's logits, 4 x 16 x 1,000 x 4 B = 256,000 B, are gathered once (1/2 sent)
    real = _sent_by_kind(ranks[0], 2)
    assert dict(est.communication_sent_bytes_by_kind) == real
    assert real[K.ALL_GATHER] == 128_000 and real[K.ALL_REDUCE] % 16_384 == 0
    assert est.communication_sent_bytes == sum(real.values())


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_sends_match_gloo(one_thread: None, schedule: str) -> None:
    pytest.importorskip("transformers")
    from vram_widget._estimating.options import OptimizerName, PipelineSchedule
    from vram_widget._profiling.distributed import run_ranks
    from vram_widget._profiling.pipeline_parallel import _config, _Layout, _loss_fn, _rank

    torch.manual_seed(0)
    model, inputs = hf_llama(), hf_tokens(4)
    est = profile_model(model, inputs=inputs, device="cpu").estimate(
        4, optimizer="adamw", gpus=2, pp=2, microbatches=2, pp_schedule=schedule
    )
    config = _config(model)

    def rank_step(stage: int, world: int) -> list[tuple[str, int, int]]:
        layout = _Layout(world, PipelineSchedule(schedule), 2)
        module = layout.copy(model, stage, meta=False)
        module.train()
        rank: Any = _rank(
            [module], stage, layout, dict(inputs), OptimizerName.ADAMW, None,
            _loss_fn(model), config.hidden_size, config.vocab_size, torch.float32,
        )  # fmt: skip
        rank.iterate()
        rank.iterate()
        return _gloo_collectives(rank.iterate, world)

    ranks = run_ranks(rank_step, 2, timeout_s=120)
    # 2 micro-batches of 2 x 16 tokens x 64 x 4 B = 8,192 B: stage 0 sends each one's
    # hidden states forward, stage 1 each one's gradient back: 16,384 B each
    sent = [_sent_by_kind(r, 2) for r in ranks]
    assert sent == [{K.SEND: 16_384}, {K.SEND: 16_384}]
    assert dict(est.communication_sent_bytes_by_kind) == {K.SEND: 16_384}
    assert est.communication_sent_bytes == 16_384


def _adamw_step(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> Callable[[], None]:
    """One AdamW training step of a Hugging Face model on ``inputs`` (which hold labels)."""
    opt = torch.optim.AdamW(model.parameters())

    def step() -> None:
        model(**inputs).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _balanced_mixtral() -> torch.nn.Module:
    """The Mixtral of tests/models.py with balanced routing (``models.routed_experts``)."""
    torch.manual_seed(0)
    return routed_experts(hf_mixtral(), "balanced")


def test_expert_parallel_collectives_match_gloo(one_thread: None) -> None:
    pytest.importorskip("transformers")
    from vram_widget._profiling.distributed import run_ranks
    from vram_widget._profiling.expert_parallel import rank_setup, resolve_ep_plan

    model, inputs = _balanced_mixtral(), hf_tokens(4)
    profile = profile_model(model, inputs=hf_tokens(2), device="cpu")
    train = profile.estimate(4, "fp32", optimizer="adamw", gpus=2, ep=2)
    inference = profile.estimate(4, "fp32", mode="inference", gpus=2, ep=2)
    setup = rank_setup(resolve_ep_plan(model, 2))

    def rank_step(_rank: int, world: int) -> tuple[list[tuple[str, int, int]], ...]:
        sharded = setup.wrap_model(model, None, None)  # type: ignore[arg-type]
        step = _adamw_step(sharded, inputs)

        def forward() -> None:
            with torch.no_grad():
                sharded(**inputs)

        sharded.train()
        step()  # the optimizer's state made
        trained = _gloo_collectives(step, world)
        sharded.eval()
        return trained, _gloo_collectives(forward, world)

    ranks = run_ranks(rank_step, 2, timeout_s=120)
    # Training, transformers' AllToAllEP over 4 x 16 = 64 shared tokens, hidden 64, top-2,
    # fp32; each rank dispatches its 32 tokens' 64 (token, expert) pairs. A layer's forward:
    # the split counts (2 ranks x 2 experts, int64: 32 B, 16 kept) and the pairs there and
    # back (64 x 64 x 4 B = 16,384 B each, half kept: 8,192 sent each), then the rank's 32
    # output rows gathered (16,384 B, 8,192 sent); its backward: the two all-to-alls again
    # (8,192 sent each) and the gathers of the row gradients of the hidden states (8,192
    # sent) and of the routing weights (32 x 2 x 4 B per rank: 256 sent).
    # 2 layers: all-to-all 2 x (16 + 4 x 8,192) = 65,568 B; all-gather 2 x 16,640 = 33,280 B
    real = [_sent_by_kind(trained, 2) for trained, _ in ranks]
    assert real == [{K.ALL_TO_ALL: 65_568, K.ALL_GATHER: 33_280}] * 2
    assert dict(train.communication_sent_bytes_by_kind) == real[0]
    assert train.communication_sent_bytes == 65_568 + 33_280
    # Inference, AllReduceEP: every rank's experts see all 64 tokens, masked, and one
    # all-reduce a layer sums the partial outputs, 64 x 64 x 4 B = 16,384 B: 2 x 1/2 x
    # 16,384 sent; 2 layers: 32,768 B
    served = [_sent_by_kind(forward, 2) for _, forward in ranks]
    assert served == [{K.ALL_REDUCE: 32_768}] * 2
    assert dict(inference.communication_sent_bytes_by_kind) == served[0]


def _run(batch: int, *collectives: Collective) -> Any:
    """A stand-in for a recorded run: its batch size and its collectives."""
    from types import SimpleNamespace

    return SimpleNamespace(batch_size=batch, collectives=collectives)


def test_collectives_fitted_in_the_batch_by_hand() -> None:
    from vram_widget._estimating.collective_fit import fit_collectives
    from vram_widget._estimating.table import Poly

    def fitted(*runs: Any) -> Any:
        batches = tuple(r.batch_size for r in runs[:-1])
        return fit_collectives(runs[:-1], lambda values: Poly.fit(batches, values), runs[-1])

    # an all-reduce of 96 B a sample (a hidden state of 24 fp32 values) and an all-to-all
    # of 32 B a sample keeping 16 B a sample, then a 1,000 B all-gather whatever the batch
    def step(batch: int, reduced: int | None = None) -> Any:
        return _run(
            batch,
            Collective(K.ALL_REDUCE, reduced or 96 * batch, 2),
            Collective(K.ALL_TO_ALL, 32 * batch, 2, own_bytes=16 * batch),
            Collective(K.ALL_GATHER, 1_000, 2),
        )

    fit = fitted(step(2), step(3), step(5))
    # at batch 6: 576 B all-reduced (576 sent), 192 B all-to-all less 96 kept, 1,000 / 2
    assert fit.at(6) == step(6).collectives
    assert volume_of(fit.at(6)).sent_bytes == 576 + 96 + 500
    assert fitted(step(2), step(3), step(5, reduced=481)) is None  # not a line: the check fails
    assert fitted(step(2), step(3), _run(5, *step(5).collectives[:2])) is None  # one fewer
    other = _run(5, Collective(K.BROADCAST, 480, 2), *step(5).collectives[1:])
    assert fitted(step(2), step(3), other) is None  # another kind
    assert fitted(step(2), _run(3, *step(3).collectives[:0]), step(5)) is None
    unrecorded = _run(3, *step(3).collectives)
    unrecorded.collectives = None
    assert fitted(step(2), unrecorded, step(5)) is None


def test_collectives_fitted_in_the_length_by_hand() -> None:
    from vram_widget._estimating.collective_fit import StepCollectives, collectives_across
    from vram_widget._estimating.table import Poly

    # an all-reduce of a (batch, seq, 1) fp32 tensor: 64 B a sample at 16 tokens, 132 B at 33
    def at_length(per_sample: int) -> StepCollectives:
        zero = np.zeros(1, np.int64)
        return StepCollectives(
            (K.ALL_REDUCE,),
            (2,),
            Poly.affine(zero, np.asarray([per_sample])),
            Poly.affine(zero, zero),
        )

    def fit(polys: tuple[Poly, ...]) -> Poly:
        return Poly.across((16, 33), polys)

    fits = (at_length(64), at_length(132))
    check = _run(5, Collective(K.ALL_REDUCE, 5 * 50 * 4, 2))  # batch 5 of 50 tokens: 1,000 B
    across = collectives_across(fits, fit, check, 50)
    assert across is not None
    assert across.at(3, 40) == (Collective(K.ALL_REDUCE, 3 * 40 * 4, 2),)  # 480 B
    assert collectives_across(fits, fit, _run(5, Collective(K.ALL_REDUCE, 999, 2)), 50) is None
    assert collectives_across((fits[0], None), fit, check, 50) is None


def test_a_rank_estimate_runs_what_a_one_device_estimate_runs(
    one_thread: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The collectives come from the runs the rank's timeline is fitted from: the rank's
    # estimate runs the batch sizes a one-device estimate runs, none at the asked batch.
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from vram_widget._profiling.step_profiler import Profiler

    batches: list[int] = []
    original = Profiler.run

    def counting(self: Profiler, precision: Any, batch_size: int, *args: Any) -> Any:
        batches.append(batch_size)
        return original(self, precision, batch_size, *args)

    monkeypatch.setattr(Profiler, "run", counting)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 24))
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    x = torch.randn(4, 32)
    profile_model(model, inputs=x, device="cpu", cache=False).estimate(6, optimizer="sgd")
    one_device, batches[:] = list(batches), []
    profile = profile_model(model, inputs=x, device="cpu", cache=False)
    est = profile.estimate(6, optimizer="sgd", gpus=2, tp=2, tp_plan=plan)
    assert len(one_device) >= 3  # a line through two batch sizes, checked at a third
    assert batches == one_device and 6 not in batches
    assert est.communication_sent_bytes == 576  # 6 x 24 x 4 B all-reduced over 2 ranks
