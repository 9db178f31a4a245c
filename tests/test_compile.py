"""Tests for the ``torch.compile`` step: ``measure(compile=...)`` (Inductor on the CPU) and
the partitioner's saved set read from the graphs (``_profiling/compiled_graphs.py``).

The hand-worked model is ``SinCos``: ``b(cos(sin(a(x))))`` with ``a = Linear(8, 16)``,
``b = Linear(16, 4)`` and a batch of 2, fp32, so each hidden tensor is 2 x 16 x 4 B = 128 B.
What each step leaves for the backward, beyond the parameters and the batch (resident):

* eager: ``a``'s output (saved by ``sin``), ``sin``'s output (saved by ``cos``) and
  ``cos``'s output (saved by ``b`` for its weight's gradient): 3 x 128 = 384 B;
* compiled (min-cut partition, budget 1.0): ``a``'s output and ``cos``'s output, the inputs
  of the backward's matmul and of the recomputation; ``sin`` is recomputed in the backward
  from ``a``'s output: 2 x 128 = 256 B;
* compiled with ``activation_memory_budget=0.0``: the whole forward recomputed in the
  backward from the parameters and the batch, which are resident: 0 B.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

from vram_widget import Recipe, profile_model, zoo
from vram_widget._estimating.compiled import (
    CompileScope,
    parse_activation_memory_budget,
    parse_compile,
)
from vram_widget._profiling.compiled import storage_bytes_of
from vram_widget._profiling.compiled_fake import fake_saved_set, graph_breaks
from vram_widget._profiling.compiled_graphs import captured_graphs
from vram_widget._profiling.measure import measure

HIDDEN_BYTES = 2 * 16 * 4  # batch 2 x 16 features x 4 B (fp32)


class SinCos(nn.Module):
    def __init__(self, out_features: int = 4) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.cos(torch.sin(self.a(x))))


class TwoBlocks(nn.Module):
    """Two ``SinCos`` blocks (8 -> 16 -> 8) in a ModuleList."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([SinCos(8), SinCos(8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class DataDependent(nn.Module):
    """A block whose Python control flow reads a tensor's value (a graph break)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum().item() > 1e9:
            return x
        return torch.relu(self.a(x))


@pytest.fixture
def batch() -> torch.Tensor:
    return torch.randn(2, 8, generator=torch.Generator().manual_seed(0))


def test_eager_saved_bytes(batch: torch.Tensor) -> None:
    m = measure(SinCos(), batch, optimizer="sgd")
    assert m.saved_bytes == 3 * HIDDEN_BYTES  # a's, sin's and cos's outputs
    assert m.compile is None


def test_compiled_saved_bytes_recompute_sin(batch: torch.Tensor) -> None:
    m = measure(SinCos(), batch, optimizer="sgd", compile=True)
    assert m.compile is CompileScope.MODEL
    assert m.saved_bytes == 2 * HIDDEN_BYTES  # a's and cos's outputs; sin recomputed
    # the same resident bytes as the eager step: the compiled module holds no copy
    assert m.resident_bytes == measure(SinCos(), batch, optimizer="sgd").resident_bytes


def test_budget_zero_recomputes_everything(batch: torch.Tensor) -> None:
    before = torch._functorch.config.activation_memory_budget
    m = measure(SinCos(), batch, optimizer="sgd", compile=True, activation_memory_budget=0.0)
    assert m.saved_bytes == 0  # the forward recomputed from the resident parameters and batch
    assert m.activation_memory_budget == 0.0
    assert torch._functorch.config.activation_memory_budget == before  # restored


def test_blocks_compiles_each_block_of_a_copy(batch: torch.Tensor) -> None:
    model = TwoBlocks()
    m = measure(model, batch, optimizer="sgd", compile="blocks")
    # per block 2 x 128 B (as SinCos compiled), and the second block's first Linear keeps
    # its input, the first block's output (eager, between the blocks): 2 x 8 x 4 B
    assert m.saved_bytes == 2 * (2 * HIDDEN_BYTES) + 2 * 8 * 4
    assert m.compile is CompileScope.BLOCKS
    # the user's blocks are not compiled (Module.compile sets _compiled_call_impl)
    assert all(block._compiled_call_impl is None for block in model.blocks)
    assert all(p.grad is None for p in model.parameters())


def test_graph_capture_saved_set_matches_measured(batch: torch.Tensor) -> None:
    """The partitioner's saved set, read from the captured graphs, is what the compiled
    step leaves for the backward (exact)."""
    compiled = measure(SinCos(), batch, optimizer="sgd", compile=True)
    with captured_graphs() as capture:
        graphs = measure(SinCos(), batch, optimizer="sgd", compile=True)
    assert len(capture.regions) == 1
    assert capture.regions[0].backward is not None
    assert capture.saved_bytes() == compiled.saved_bytes == 2 * HIDDEN_BYTES
    assert graphs.saved_bytes == compiled.saved_bytes  # the graphs run eagerly save the same


def test_inference_has_no_saved_bytes(batch: torch.Tensor) -> None:
    m = measure(SinCos(), batch, mode="inference", compile=True)
    assert m.saved_bytes is None
    assert m.peak_bytes >= m.resident_bytes + 2 * 4 * 4  # the output, 2 x 4 x 4 B


def test_dynamo_refusal_gives_its_reason(batch: torch.Tensor) -> None:
    model = TwoBlocks()
    model.blocks = nn.ModuleList([DataDependent(), DataDependent()])
    with pytest.raises(ValueError, match=r"could not compile this model: .*data-dependent") as info:
        measure(model, batch, optimizer="sgd", compile="blocks")  # fullgraph=True
    assert info.value.__cause__ is None and info.value.__suppress_context__


class TorchLayers(nn.Module):
    """Two of torch's own ``nn.TransformerEncoderLayer`` (width 8) in a ModuleList."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            [nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True) for _ in "ab"]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


# slow: a refusal, the same under any instruction set; left to the first CI pass
@pytest.mark.slow
def test_blocks_of_torch_modules_refused_with_dynamos_reason() -> None:
    """Dynamo compiles no frame of a torch.nn layer compiled on its own (its forward is in
    dynamo's skip list): a ValueError with dynamo's message and the way out, from the
    measured step and from the estimate, not dynamo's RuntimeError."""
    x = torch.randn(2, 4, 8)
    match = r"could not compile this model: .*found no compiled frames.*compile=True"
    with pytest.raises(ValueError, match=match):
        measure(TorchLayers(), x, optimizer="sgd", compile="blocks")
    with pytest.raises(ValueError, match=match):
        _profile(TorchLayers(), x).estimate(2, optimizer="sgd", compile="blocks")
    # the whole model compiles: dynamo inlines the layers from the model's own forward (the
    # frames the refusal above is about, compiled here in an inference step; the training
    # step of nn.TransformerEncoder layers compiled whole is compared with Inductor's to the
    # byte in benchmarks/accuracy_compile.py, "transformer_encoder")
    assert measure(TorchLayers(), x, mode="inference", compile=True).peak_bytes > 0


def test_blocks_needs_repeated_blocks(batch: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="no such list; use compile=True"):
        measure(SinCos(), batch, compile="blocks")


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (1.5, ValueError, r"outside \[0, 1\]"),
        (-0.1, ValueError, r"outside \[0, 1\]"),
        (float("nan"), ValueError, r"outside \[0, 1\]"),
        ("0.5", TypeError, "a number in"),
        (True, TypeError, "a number in"),
    ],
)
def test_bad_budget(value: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        parse_activation_memory_budget(value, CompileScope.MODEL)


def test_budget_needs_compile(batch: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="give compile=True"):
        measure(SinCos(), batch, activation_memory_budget=0.5)


def test_bad_compile_values(batch: torch.Tensor) -> None:
    assert parse_compile(None) is None and parse_compile(False) is None
    assert parse_compile(" Blocks ") is CompileScope.BLOCKS
    for bad in ("max-autotune", 1, "inductor"):
        with pytest.raises(ValueError, match="valid values are False or None"):
            parse_compile(bad)
    with pytest.raises(ValueError, match=r"strategy='ddp': not estimated \(nor measured\)"):
        measure(SinCos(), batch, compile=True, gpus=2)
    with pytest.raises(ValueError, match="loss_chunks"):
        measure(SinCos(), batch, compile=True, loss_chunks=2)


def test_storage_bytes_of_counts_each_storage_once() -> None:
    t = torch.zeros(4, 4)  # 64 B
    # a view and the tensor itself share one storage; the dict holds a second, 3 x 4 B
    assert storage_bytes_of((t, t[1:], {"x": torch.zeros(3)}, [None, 2])) == 64 + 12


class Broken(nn.Module):
    """SinCos with an explicit graph break between its two Linears."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = SinCos(16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inner(x)
        torch._dynamo.graph_break()
        return self.out(torch.sin(h))


def test_fake_saved_set_matches_measured(batch: torch.Tensor) -> None:
    """The saved set from the partitioned graphs on fake tensors is the measured one."""
    model = SinCos()
    fake = fake_saved_set(model, batch)
    assert fake.saved_bytes == measure(model, batch, compile=True).saved_bytes
    assert fake.saved_bytes == 2 * HIDDEN_BYTES and fake.region_count == 1
    assert fake_saved_set(model, batch, activation_memory_budget=0.0).saved_bytes == 0
    # the model is left as it was: real parameters, no gradients
    assert all(type(p) is nn.Parameter and not p.is_meta for p in model.parameters())
    assert all(p.grad is None for p in model.parameters())
    assert model.a.weight.data_ptr() != 0


def test_fake_saved_set_across_a_graph_break(batch: torch.Tensor) -> None:
    model = Broken()
    fake = fake_saved_set(model, batch)
    assert fake.region_count == 2
    # region 1 as SinCos (8 -> 16 -> 16): a's and cos's outputs, 2 x 128 B; region 2 keeps
    # its input h (sin's input, 2 x 16 x 4 B) and sin(h) (out's input, 2 x 16 x 4 B)
    assert fake.saved_bytes == 2 * HIDDEN_BYTES + 2 * HIDDEN_BYTES
    assert fake.saved_bytes == measure(model, batch, compile=True).saved_bytes
    breaks = graph_breaks(model, batch)
    assert len(breaks) == 1 and "test_compile.py" in breaks[0]


class FourBlocks(TwoBlocks):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([SinCos(8) for _ in range(4)])


def test_one_graph_serving_several_blocks(batch: torch.Tensor) -> None:
    """Blocks whose guards pass share one compiled graph: each call's saved values count."""
    # per block 2 x 128 B (as SinCos compiled); blocks 2-4 keep their input, the block
    # before's output, 2 x 8 x 4 B each (saved by the block's first Linear)
    expected = 4 * (2 * HIDDEN_BYTES) + 3 * (2 * 8 * 4)
    with captured_graphs() as capture:
        measured = measure(FourBlocks(), batch, optimizer="sgd", compile="blocks")
    assert measured.saved_bytes == capture.saved_bytes() == expected
    assert len(capture.regions) < 4  # fewer graphs than block calls
    fake = fake_saved_set(FourBlocks(), batch, compile="blocks")
    assert fake.saved_bytes == expected


# -- the estimate: profile_model(...).estimate(compile=...) -----------------------------------


def _profile(model: nn.Module, batch: torch.Tensor) -> Any:
    return profile_model(model, inputs=batch, device="cpu", cache=False)


def test_estimate_saved_set_hand_worked(batch: torch.Tensor) -> None:
    """SinCos (module docstring): eager 3 x 128 B saved; compiled 2 x 128 B (sin recomputed
    from a's output); budget 0.0: nothing (the forward recomputed from the resident
    parameters and batch). Each is the measured compiled step's, to the byte."""
    model = SinCos()
    profile = _profile(model, batch)
    eager = profile.estimate(2, optimizer="sgd")
    compiled = profile.estimate(2, optimizer="sgd", compile=True)
    nothing = profile.estimate(2, optimizer="sgd", compile=True, activation_memory_budget=0.0)
    assert eager.saved_bytes == 3 * HIDDEN_BYTES and not eager.compile_bound
    assert compiled.saved_bytes == 2 * HIDDEN_BYTES
    assert nothing.saved_bytes == 0
    assert compiled.levers.compile == "model" and nothing.levers.activation_memory_budget == 0.0
    for est, budget in ((compiled, None), (nothing, 0.0)):
        measured = measure(
            model, batch, optimizer="sgd", compile=True, activation_memory_budget=budget
        )
        assert est.saved_bytes == measured.saved_bytes
        # the region temporaries are Inductor's generated code's, run on fake tensors
        assert not est.compile_bound and est.compile_fallbacks == ()
        assert est.peak_bytes == measured.peak_bytes
    # the same resident bytes as the eager estimate: parameters (8 x 16 + 16 + 16 x 4 + 4)
    # x 4 B = 848 B and the batch, 2 x 8 x 4 B = 64 B
    assert compiled.parameter_bytes == eager.parameter_bytes == 848
    assert compiled.input_bytes == 64


def test_estimate_blocks_and_graph_breaks(batch: torch.Tensor) -> None:
    """compile='blocks': each block's partition, the eager code between blocks as it runs;
    a graph break: two regions, each partitioned on its own (the fake_saved_set tests above
    work both by hand)."""
    blocks = _profile(TwoBlocks(), batch).estimate(2, optimizer="sgd", compile="blocks")
    assert blocks.saved_bytes == 2 * (2 * HIDDEN_BYTES) + 2 * 8 * 4
    broken = _profile(Broken(), batch).estimate(2, optimizer="sgd", compile=True)
    assert broken.saved_bytes == 2 * HIDDEN_BYTES + 2 * HIDDEN_BYTES
    assert broken.saved_bytes == measure(Broken(), batch, optimizer="sgd", compile=True).saved_bytes


def test_estimate_leaves_the_model_as_it_was(batch: torch.Tensor) -> None:
    model = TwoBlocks()
    before = [p.detach().clone() for p in model.parameters()]
    _profile(model, batch).estimate(2, optimizer="sgd", compile="blocks")
    assert all(block._compiled_call_impl is None for block in model.blocks)
    assert all(p.grad is None and type(p) is nn.Parameter for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


class Indexed(nn.Module):
    """A block whose forward reads its own index (as transformers' ``layer_idx``)."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(self.a(x)) * (self.index + 1)


def test_blocks_past_the_recompile_limit_say_why(batch: torch.Tensor) -> None:
    model = TwoBlocks()
    limit = torch._dynamo.config.recompile_limit  # 8 by default
    model.blocks = nn.ModuleList([Indexed(i) for i in range(limit + 2)])
    with pytest.raises(ValueError, match=r"a graph of its own .* \(FailOnRecompileLimitHit\)"):
        _profile(model, batch).estimate(2, optimizer="sgd", compile="blocks")


def test_estimate_refusals(batch: torch.Tensor) -> None:
    profile = _profile(SinCos(), batch)
    with pytest.raises(ValueError, match=r"outside \[0, 1\]"):
        profile.estimate(2, compile=True, activation_memory_budget=1.5)
    with pytest.raises(ValueError, match="give compile=True"):
        profile.estimate(2, activation_memory_budget=0.5)
    with pytest.raises(ValueError, match="valid values are False or None"):
        profile.estimate(2, compile="max-autotune")
    with pytest.raises(ValueError, match="mode='inference': the compiled step is estimated"):
        profile.estimate(2, mode="inference", compile=True)
    with pytest.raises(ValueError, match=r"strategy='ddp': not estimated \(nor measured\)"):
        profile.estimate(2, compile=True, gpus=2)
    with pytest.raises(ValueError, match="no such list; use compile=True"):
        profile.estimate(2, compile="blocks")


def test_estimate_dynamo_refusal_gives_its_reason(batch: torch.Tensor) -> None:
    model = TwoBlocks()
    model.blocks = nn.ModuleList([DataDependent(), DataDependent()])
    with pytest.warns(UserWarning, match="fake tensors cannot run this model"):
        profile = _profile(model, batch)  # .item(): profiled on real CPU tensors
    with pytest.raises(ValueError, match=r"could not compile this model: .*data-dependent"):
        profile.estimate(2, optimizer="sgd", compile="blocks")


def test_recipe_carries_compile() -> None:
    recipe = Recipe.from_keywords(compile="blocks", activation_memory_budget=0.5)
    assert recipe.levers.compile == "blocks" and recipe.get("activation_memory_budget") == 0.5
    with pytest.raises(ValueError, match="conflicts with the recipe"):
        Recipe.from_keywords(recipe, compile=True)


@pytest.mark.slow
@pytest.mark.parametrize("budget", [0.1])  # the default budget: benchmarks/accuracy_compile.py
def test_estimate_gpt2_saved_set_is_measured(budget: float | None) -> None:
    """A tiny Hugging Face GPT-2 (2 layers, 64 wide, vocabulary 1000), batch 4 x 16 tokens,
    fp32, AdamW: the estimate's saved bytes are the measured compiled step's plus the
    logits, which the loss saves and measure counts as the forward's output
    (4 x 16 x 1000 x 4 B = 256,000 B); its peak bounds the measured one from above."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=64,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    gen = torch.Generator().manual_seed(0)
    names = ("input_ids", "labels")
    inputs = {name: torch.randint(0, 1000, (4, 16), generator=gen) for name in names}
    profile = profile_model(model, inputs=inputs, device="cpu", cache=False)
    est = profile.estimate(4, optimizer="adamw", compile=True, activation_memory_budget=budget)
    measured = measure(
        model, inputs, optimizer="adamw", compile=True, activation_memory_budget=budget
    )
    assert est.saved_bytes == measured.saved_bytes + 4 * 16 * 1000 * 4
    assert measured.peak_bytes <= est.peak_bytes <= 1.15 * measured.peak_bytes


# -- compile composed with checkpointing and LoRA ----------------------------------------------


@pytest.mark.parametrize("scope", [True, "blocks"])
def test_checkpointed_blocks_compiled(batch: torch.Tensor, scope: object) -> None:
    """FourBlocks, each block in torch's checkpoint_wrapper, then compiled (torchtitan's
    apply_ac, then apply_compile). Each checkpointed block keeps only its input for the
    backward: the batch for the first (resident, not counted) and the block before's output,
    2 x 8 x 4 B = 64 B, for the other three: 3 x 64 = 192 B, against 4 x 256 + 3 x 64 B
    compiled without checkpointing (test_one_graph_serving_several_blocks)."""
    model = FourBlocks()
    profile = _profile(model, batch)
    est = profile.estimate(2, optimizer="sgd", compile=scope, checkpoint="auto")
    measured = measure(model, batch, optimizer="sgd", compile=scope, checkpoint="auto")
    assert est.saved_bytes == measured.saved_bytes == 3 * (2 * 8 * 4)
    assert est.peak_bytes == measured.peak_bytes  # the region temporaries are Inductor's
    assert est.levers.checkpoint and est.levers.compile == parse_compile(scope)
    # the model is left as it was: no wrapper, no compiled block
    blocks = list(model.blocks)
    assert all(type(b) is SinCos and b._compiled_call_impl is None for b in blocks)


def test_checkpoint_policy_op_compiled(batch: torch.Tensor) -> None:
    """torchtitan's op-level policy inside the compiled region: the partitioner keeps what
    the policy saves, as the real compiled step does; more than full checkpointing keeps
    (every block's input, 192 B: above)."""
    model = FourBlocks()
    settings: dict[str, Any] = {"checkpoint": "auto", "checkpoint_policy": "op"}
    est = _profile(model, batch).estimate(2, optimizer="sgd", compile=True, **settings)
    measured = measure(model, batch, optimizer="sgd", compile=True, **settings)
    assert est.saved_bytes == measured.saved_bytes
    assert est.saved_bytes > 3 * (2 * 8 * 4)


class Dropped(nn.Module):
    """SinCos with a dropout after its first Linear: a random op inside the checkpointed
    region, which the compiled graphs run in torch's RNG higher-order ops."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.5)
        self.b = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.sin(self.drop(self.a(x))))


def test_checkpointed_dropout_compiled(batch: torch.Tensor) -> None:
    model = TwoBlocks()
    model.blocks = nn.ModuleList([Dropped(), Dropped()])
    est = _profile(model, batch).estimate(2, optimizer="sgd", compile=True, checkpoint="auto")
    measured = measure(model, batch, optimizer="sgd", compile=True, checkpoint="auto")
    # the second block's input (2 x 8 x 4 B) and the RNG state its dropout is replayed
    # with (the CPU generator's, which a compiled CPU step keeps too)
    assert est.saved_bytes == measured.saved_bytes
    assert est.saved_bytes >= 2 * 8 * 4


def test_lora_compiled(batch: torch.Tensor) -> None:
    """PEFT wraps the model, then it is compiled (Hugging Face's Trainer): the LoRA
    sub-profile's compiled step keeps what the real one keeps."""
    pytest.importorskip("peft")
    model = SinCos()
    lora: dict[str, Any] = {"lora_rank": 2, "lora_targets": ["a", "b"]}
    profile = _profile(model, batch)
    est = profile.estimate(2, optimizer="adamw", compile=True, **lora)
    measured = measure(model, batch, optimizer="adamw", compile=True, **lora)
    assert est.saved_bytes == measured.saved_bytes
    assert est.peak_bytes >= measured.peak_bytes
    assert est.levers.lora_rank == 2 and est.levers.compile == "model"
    eager = profile.estimate(2, optimizer="adamw", **lora)
    assert est.saved_bytes != eager.saved_bytes  # the partitioner's set, not the eager one


def test_compiled_estimate_is_cached(batch: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled step is profiled once per setting and batch: a second estimate runs
    nothing, and is_cached says so (at the batch it was profiled at only)."""
    from vram_widget._profiling.profiler import _Source

    runs: list[str] = []
    original = _Source.timeline

    def counted(source: _Source, *args: Any, **kwargs: Any) -> Any:
        runs.append("timeline")
        return original(source, *args, **kwargs)

    monkeypatch.setattr(_Source, "timeline", counted)
    profile = _profile(FourBlocks(), batch)
    levers = dataclasses.replace(profile.levers(checkpoint="auto"), compile="model")
    assert not profile.is_cached("fp32", "train", None, levers=levers, batch_size=2)
    first = profile.estimate(2, optimizer=None, compile=True, checkpoint="auto")
    assert runs == ["timeline"]
    assert profile.is_cached("fp32", "train", None, levers=levers, batch_size=2)
    assert not profile.is_cached("fp32", "train", None, levers=levers, batch_size=3)
    assert not profile.is_cached("fp32", "train", None, levers=levers)  # which batch?
    again = profile.estimate(2, optimizer=None, compile=True, checkpoint="auto")
    assert runs == ["timeline"] and again.peak_bytes == first.peak_bytes


# -- the compiled step's peak against the real Inductor step -----------------------------------


def _truth(model: nn.Module, inputs: Any, runs: list[tuple[str, float, object]]) -> list[str]:
    """Each (precision, budget, compile) estimated from the plain model's profile and
    measured (``measure(compile=...)``: Inductor's real step on the CPU), AdamW, batch 4;
    the configurations whose peak or saved set differs, with both numbers."""
    profile = profile_model(model, inputs=inputs, device="cpu", cache=False)
    wrong = []
    for precision, budget, scope in runs:
        settings: dict[str, Any] = {"compile": scope, "activation_memory_budget": budget}
        est = profile.estimate(4, precision, "adamw", **settings)
        measured = measure(model, inputs, optimizer="adamw", precision=precision, **settings)
        assert not est.compile_bound and est.compile_fallbacks == ()  # Inductor's code ran
        if (est.peak_bytes, est.saved_bytes) != (measured.peak_bytes, measured.saved_bytes):
            wrong.append(
                f"{precision} {budget} {scope}: peak {est.peak_bytes} vs {measured.peak_bytes}, "
                f"saved {est.saved_bytes} vs {measured.saved_bytes}"
            )
    return wrong


def test_mlp_compiled_peak_is_inductors() -> None:
    """The zoo MLP (784 -> 512 -> 512 -> 10, dropout 0.1), fp32 at budget 1.0 and bf16 at
    0.5: the estimated peak and saved set are the real compiled step's, to the byte (the
    region temporaries are Inductor's buffer plan, run on fake tensors)."""
    torch.manual_seed(0)
    inputs = torch.randn(4, 784, generator=torch.Generator().manual_seed(0))
    runs: list[tuple[str, float, object]] = [("fp32", 1.0, True), ("bf16", 0.5, True)]
    assert _truth(zoo.mlp(), inputs, runs) == []


def test_a_graph_inductor_cannot_run_falls_back_node_by_node(
    batch: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where Inductor's code for a graph cannot be generated, the graph runs node by node:
    the estimate says so (``compile_bound``, with Inductor's reason) and its peak bounds
    the compiled step's from above; the saved set is the partitioner's still."""
    from vram_widget._profiling import compiled_inductor

    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise NotImplementedError("no code for this graph")

    monkeypatch.setattr(compiled_inductor, "inductor_graph", refuse)
    est = _profile(SinCos(), batch).estimate(2, optimizer="sgd", compile=True)
    measured = measure(SinCos(), batch, optimizer="sgd", compile=True)
    assert est.compile_bound
    assert len(est.compile_fallbacks) == 2  # the forward and the backward graph
    assert "NotImplementedError: no code for this graph" in est.compile_fallbacks[0]
    assert est.saved_bytes == measured.saved_bytes == 2 * HIDDEN_BYTES


# -- a Hugging Face Llama: compile with LoRA and with Trainer-style checkpointing --------------
#
# tests/models.py's Llama (2 layers of 64, MLP 128, 4 heads of 16, 2 key/value heads,
# vocabulary 1000), batch 2 x 16 tokens, fp32, AdamW. ``est.saved_bytes`` counts the model's
# outputs that the backward keeps; ``measure``'s ``saved_bytes`` leaves every output out. Two
# outputs are kept: the logits (the compiled graph saves them for the loss's backward),
# 2 x 16 x 1000 x 4 B = 128,000 B, and the KV cache, which transformers' LlamaModel returns in
# training too (``use_cache`` defaults to True: a DynamicCache holding each layer's key and
# value after the rotary embedding, which the attention's backward keeps), 2 layers x 2 x
# (2 x 2 heads x 16 x 16 x 4 B) = 16,384 B. With gradient checkpointing, transformers turns
# the cache off in training (use_cache=False), and only the logits remain.

_LOGITS_BYTES = 2 * 16 * 1000 * 4
_KV_CACHE_BYTES = 2 * 2 * (2 * 2 * 16 * 16 * 4)


@pytest.fixture(scope="module")
def llama() -> tuple[nn.Module, Any]:
    pytest.importorskip("transformers")
    from models import hf_llama, hf_tokens

    torch.manual_seed(0)
    model = hf_llama()
    return model, profile_model(model, inputs=hf_tokens(2), device="cpu", cache=False)


def test_llama_lora_compiled_saved_set_and_peak(llama: tuple[nn.Module, Any]) -> None:
    """PEFT's LoRA (rank 4 on q_proj and v_proj), then the whole model compiled: the saved
    set is the measured one plus the kept outputs (above), to the byte; the peak is the
    real compiled step's (Inductor's buffer plan), to the byte, below the partitioned
    graphs' run node by node."""
    pytest.importorskip("peft")
    from models import hf_tokens

    model, profile = llama
    settings: dict[str, Any] = {"optimizer": "adamw", "compile": True, "lora_rank": 4}
    est = profile.estimate(2, "fp32", **settings)
    measured = measure(model, hf_tokens(2), **settings)
    with captured_graphs():
        graphs = measure(model, hf_tokens(2), **settings)
    assert est.saved_bytes == measured.saved_bytes + _LOGITS_BYTES + _KV_CACHE_BYTES
    assert graphs.saved_bytes == measured.saved_bytes
    assert not est.compile_bound
    assert est.peak_bytes == measured.peak_bytes  # the region temporaries are Inductor's
    assert est.peak_bytes < graphs.peak_bytes  # ... which fuse what the graphs' ops make
    # the outputs are the logits, the KV cache and the loss (4 B)
    model.train()
    with torch.no_grad():
        out = model(**hf_tokens(2))
    assert out.cache is not None  # use_cache=True in training
    assert storage_bytes_of(out) == _LOGITS_BYTES + _KV_CACHE_BYTES + 4


# The other models of the grid (the TransformerEncoder, GPT-2 and BERT, batch 1 and 4, fp32
# and bf16, four budgets, both scopes) are compared with Inductor's real step in
# benchmarks/accuracy_compile.py; the tests keep the MLP above and this Llama (the ``llama``
# fixture: one model and one profile for every Llama test of this module).
@pytest.mark.slow
def test_hf_llama_compiled_peak_is_inductors(llama: tuple[nn.Module, Any]) -> None:
    """tests/models.py's Llama (2 layers, 64 wide, vocabulary 1000, 2 x 16 tokens), bf16,
    budget 0.5, the whole model compiled and each block on its own: the estimated peak is
    the real compiled step's, to the byte. (The saved set, which counts the loss's own
    saved logits apart, is checked by the GPT-2 test above.)"""
    from models import hf_tokens

    model, profile = llama
    for budget, scope in ((0.5, "model"), (0.5, "blocks")):
        settings: dict[str, Any] = {"compile": scope, "activation_memory_budget": budget}
        est = profile.estimate(2, "bf16", "adamw", **settings)
        measured = measure(model, hf_tokens(2), optimizer="adamw", precision="bf16", **settings)
        assert not est.compile_bound
        assert est.peak_bytes == measured.peak_bytes


# slow: two Inductor compiles of the Llama (about a minute on two cores); the narrowed-ISA
# pass keeps the compiled Llama's peak to the byte in the LoRA test above and the op-level
# policy inside a compiled region in test_checkpoint_policy_op_compiled
@pytest.mark.slow
def test_llama_trainer_checkpointing_op_policy_compiled(llama: tuple[nn.Module, Any]) -> None:
    """Hugging Face's Trainer-style checkpointing (checkpoint="auto":
    gradient_checkpointing_enable on the decoder layers) with torchtitan's op-level policy,
    then the model compiled: the partitioner keeps what the policy saves, as the real
    compiled step does; the KV cache is off under checkpointing, so only the logits are
    the outputs kept."""
    from models import hf_tokens

    model, profile = llama
    settings: dict[str, Any] = {
        "optimizer": "adamw",
        "compile": True,
        "checkpoint": "auto",
        "checkpoint_policy": "op",
    }
    est = profile.estimate(2, "fp32", **settings)
    measured = measure(model, hf_tokens(2), **settings)
    assert est.levers.checkpoint_hf and est.levers.compile == "model"
    assert est.saved_bytes == measured.saved_bytes + _LOGITS_BYTES
    assert est.peak_bytes == measured.peak_bytes
