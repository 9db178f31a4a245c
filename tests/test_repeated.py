"""A stack of identical blocks recorded with 3 and 4 of them, the run with all N derived
(``_profiling/repeated.py``): every derived run equals the full run to the byte, and a
stack whose blocks differ is run in full."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from vram_widget import profile_model  # noqa: E402
from vram_widget._estimating.options import Mode, Precision  # noqa: E402
from vram_widget._profiling import repeated  # noqa: E402
from vram_widget._profiling.profiler import _Source  # noqa: E402


def _llama(layers: int = 9) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=512,
    )
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def _gpt2(layers: int = 8) -> torch.nn.Module:
    config = transformers.GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=64)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        return transformers.GPT2LMHeadModel(config)


def _inputs(batch: int = 2, seq: int = 16) -> dict[str, torch.Tensor]:
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return {"input_ids": ids, "labels": ids}


def _profile(model: torch.nn.Module, derived: bool) -> object:
    profile = profile_model(model, inputs=_inputs(), device="cuda", precisions=(), cache=False)
    _source(profile).use_repeated = derived  # a private switch, for these comparisons
    return profile


def _source(profile: object) -> _Source:
    source = profile._source  # type: ignore[attr-defined]
    return getattr(source, "inner", source)


def _same_trace(a: object, b: object) -> None:
    for field in dataclasses.fields(a):  # type: ignore[arg-type]
        x, y = getattr(a, field.name), getattr(b, field.name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y), field.name
        else:
            assert x == y, field.name


@pytest.mark.parametrize("build", [_llama, _gpt2])
@pytest.mark.parametrize("mode", [Mode.TRAIN, Mode.INFERENCE])
@pytest.mark.parametrize("precision", [Precision.FP32, Precision.BF16])
def test_derived_run_is_the_full_run(build, mode, precision) -> None:
    """Every field of the derived trace (events, storages, FLOPs per row, output shapes,
    the marks) equals the full run's, storage numbering included."""
    profile = _profile(build(), True)
    source = _source(profile)
    derived = source._derived_run(precision, 3, mode, True)
    assert derived is not None and not source._not_repeated
    with source._as_every_run():
        full = source._run_once(precision, 3, mode, True)
    _same_trace(derived, full)
    # the full run records each block: 9 or 8 of them against the copies' 3 and 4
    stack = repeated.find_stack(source.profiler.subject.model)
    assert stack is not None and stack.count == len(build().get_submodule(stack.path))


@pytest.mark.parametrize(
    "settings",
    [
        {"precision": "bf16", "optimizer": "adamw"},
        {"precision": "amp-bf16", "optimizer": "adam", "checkpoint": "auto"},
        {"precision": "fp32", "optimizer": "sgd", "loss_chunks": 4},
        {"precision": "bf16", "optimizer": "adamw", "seq_len": 61},
        {"precision": "fp32", "optimizer": None, "mode": "inference"},
    ],
)
def test_estimates_equal_the_full_runs(settings) -> None:
    """Estimates at several batch sizes, levers and another length (the length fit) from
    the derived runs equal those from full runs: peak, breakdown, FLOPs, the layer table."""
    derived = _profile(_llama(), True)
    full = _profile(_llama(), False)
    for batch in (1, 5):
        a = derived.estimate(batch, **settings)  # type: ignore[attr-defined]
        b = full.estimate(batch, **settings)  # type: ignore[attr-defined]
        assert a.peak_bytes == b.peak_bytes
        assert a.to_dataframe().equals(b.to_dataframe())
        assert repr(a) == repr(b)
    source = _source(derived)
    assert source._reduced and not source._not_repeated


def test_blocks_that_differ_are_run_in_full() -> None:
    """A per-layer list in the config (Qwen2's sliding and full attention by layer) or a
    block with another shape leaves the stack unused."""
    config = transformers.Qwen2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=9,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=4,
    )
    with torch.device("meta"):
        qwen = transformers.Qwen2ForCausalLM(config)
    assert len(set(config.layer_types)) == 2
    assert repeated.find_stack(qwen) is None
    model = _llama()
    assert repeated.find_stack(model) == repeated.BlockStack("model.layers", 9)
    with torch.device("meta"):
        model.model.layers[4].mlp.up_proj = torch.nn.Linear(32, 64, bias=True)
    assert repeated.find_stack(model) is None


def test_the_model_is_left_as_it_was() -> None:
    model = _llama()
    before = [(n, p) for n, p in model.named_parameters()]
    profile = _profile(model, True)
    profile.estimate(2, "bf16", "adamw")  # type: ignore[attr-defined]
    assert [(n, p) for n, p in model.named_parameters()] == before
    assert len(model.model.layers) == 9
    assert "model.layers.8.mlp" in profile.rows.names  # type: ignore[attr-defined]
