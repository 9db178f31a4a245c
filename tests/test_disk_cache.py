"""The on-disk profile cache (vram_widget._profiling.disk_cache) and profile_model's
``precisions=``: a second process answers from the cache without a run, every part of the key
misses when changed, a broken cache is a warning and never an error, and a profile runs only
the precisions asked."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import types
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from models import assert_model_unchanged, snapshot_model
from torch import nn

import vram_widget
from vram_widget import CacheWarning, Mode, Precision, profile_model
from vram_widget._profiling import disk_cache
from vram_widget._profiling.profiler import _Source

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _cache_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/conftest.py turns the cache off for every other test."""
    monkeypatch.delenv("VRAM_WIDGET_CACHE", raising=False)


class Counted:
    """Counts the profiler's source calls (each a run of the model on a miss)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, Any]] = []
        for name in ("timeline", "optimizer_trace", "timeline_across_lengths"):
            original = getattr(_Source, name)
            monkeypatch.setattr(_Source, name, self._counting(name, original))

    def _counting(self, name: str, original: Any) -> Any:
        def counted(source: _Source, *args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args[:2]))
            return original(source, *args, **kwargs)

        return counted

    def count(self) -> int:
        n = len(self.calls)
        self.calls.clear()
        return n


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


class _Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class _TwiceEdited(nn.Module):
    """The structure of _Twice; its forward keeps one more tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x * 2)


# -- a second process ------------------------------------------------------------------------

_SCRIPT = """
import json, sys
import numpy as np
from vram_widget import zoo, profile_model
from vram_widget._profiling.profiler import _Source
calls = []
for name in ("timeline", "optimizer_trace"):
    original = getattr(_Source, name)
    def counted(self, *a, _original=original, _name=name, **k):
        calls.append(_name)
        return _original(self, *a, **k)
    setattr(_Source, name, counted)
profile = profile_model(zoo.mlp(), input_size=(784,), device="cuda")
est = profile.estimate(16, "fp32", "adam")
print(json.dumps({
    "calls": calls,
    "peak": est.peak_bytes,
    "breakdown": {c.value: int(v) for c, v in est.peak_breakdown.items()},
    "live": est.live_bytes.tolist(),
    "phase": est.event_phase.tolist(),
}))
"""


def _in_new_process(cache_dir: Path) -> dict[str, Any]:
    env = {**os.environ, "VRAM_WIDGET_CACHE_DIR": str(cache_dir), "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return json.loads(done.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def test_second_process_answers_from_the_cache(tmp_path: Path) -> None:
    cold = _in_new_process(tmp_path)
    # what the fp32 / Adam estimate needs, each run once: the training timeline and Adam's
    # trace (profile_model defers its runs; no inference pass is asked)
    assert cold["calls"] == ["timeline", "optimizer_trace"]
    warm = _in_new_process(tmp_path)
    assert warm["calls"] == []  # nothing ran
    for key in ("peak", "breakdown", "live", "phase"):
        assert warm[key] == cold[key]


# -- the key ---------------------------------------------------------------------------------


def _profile_count(counted: Counted, model: nn.Module, **kwargs: Any) -> int:
    kwargs.setdefault("input_size", (4,))
    profile_model(model, precisions=("fp32",), **kwargs)
    return counted.count()


def test_same_model_again_is_a_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    counted = Counted(monkeypatch)
    assert _profile_count(counted, _net()) == 3  # train, inference, Adam
    assert _profile_count(counted, _net()) == 0  # rebuilt the same: the same key


@pytest.mark.parametrize(
    "changed",
    [
        pytest.param(
            lambda: nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2)), id="shape"
        ),
        pytest.param(lambda: _net().to(torch.float64), id="dtype"),
        pytest.param(lambda: nn.Sequential(nn.Linear(4, 3), nn.GELU(), nn.Linear(3, 2)), id="type"),
        pytest.param(
            lambda: nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2, bias=False)),
            id="bias",
        ),
    ],
)
def test_changed_structure_misses(monkeypatch: pytest.MonkeyPatch, changed: Any) -> None:
    counted = Counted(monkeypatch)
    assert _profile_count(counted, _net()) == 3
    assert _profile_count(counted, changed()) == 3


def test_changed_input_shape_misses(monkeypatch: pytest.MonkeyPatch) -> None:
    counted = Counted(monkeypatch)
    model = nn.Linear(4, 2)
    assert _profile_count(counted, model, input_size=None, inputs=torch.zeros(2, 4)) == 3
    assert _profile_count(counted, model, input_size=None, inputs=torch.zeros(2, 3, 4)) == 3
    assert _profile_count(counted, model, input_size=None, inputs=torch.zeros(2, 3, 4)) == 0


def test_edited_forward_misses(monkeypatch: pytest.MonkeyPatch) -> None:
    counted = Counted(monkeypatch)
    assert _profile_count(counted, _Twice()) == 3
    assert _profile_count(counted, _TwiceEdited()) == 3
    assert _profile_count(counted, _Twice()) == 0


def test_attention_implementation_misses(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two GPT-2s of one structure, parameters and JSON config, but eager against SDPA
    # attention (config._attn_implementation, which to_json_string leaves out): their steps
    # differ (the eager one saves the B x H x T x T scores), so their profiles must too.
    transformers = pytest.importorskip("transformers")

    def gpt2(attention: str) -> nn.Module:
        config = transformers.GPT2Config(
            n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64,
            attn_implementation=attention,
        )  # fmt: skip
        with torch.device("meta"):
            return transformers.GPT2LMHeadModel(config)

    ids = torch.zeros(2, 16, dtype=torch.long)
    counted = Counted(monkeypatch)
    inputs = {"input_ids": ids, "labels": ids}
    assert _profile_count(counted, gpt2("eager"), input_size=None, inputs=inputs) == 3
    assert _profile_count(counted, gpt2("sdpa"), input_size=None, inputs=inputs) == 3
    assert _profile_count(counted, gpt2("sdpa"), input_size=None, inputs=inputs) == 0


def test_device_misses(monkeypatch: pytest.MonkeyPatch) -> None:
    counted = Counted(monkeypatch)
    assert _profile_count(counted, _net(), device="cuda") == 3
    assert _profile_count(counted, _net(), device="cpu") == 3


def test_library_version_misses(monkeypatch: pytest.MonkeyPatch) -> None:
    counted = Counted(monkeypatch)
    assert _profile_count(counted, _net()) == 3
    monkeypatch.setattr(vram_widget, "__version__", "0.0.0-other")
    assert _profile_count(counted, _net()) == 3
    monkeypatch.setattr(disk_cache, "_version", lambda package: f"{package}-other")
    assert _profile_count(counted, _net()) == 3  # transformers' and peft's versions


def _sum_loss(out: torch.Tensor) -> torch.Tensor:
    return out.sum()


def _square_loss(out: torch.Tensor) -> torch.Tensor:
    return (out * out).sum()


def test_loss_fn_misses(monkeypatch: pytest.MonkeyPatch) -> None:
    counted = Counted(monkeypatch)
    assert _profile_count(counted, _net(), loss_fn=_sum_loss) == 3
    assert _profile_count(counted, _net(), loss_fn=_square_loss) == 3
    assert _profile_count(counted, _net(), loss_fn=_sum_loss) == 0
    assert _profile_count(counted, _net()) == 3  # the default loss


def test_loss_over_a_tensor_is_not_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = torch.zeros(2)

    def loss(out: torch.Tensor) -> torch.Tensor:
        return (out - target).sum()  # closes over a tensor: its state is not hashed

    counted = Counted(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # skipped without a word
        assert _profile_count(counted, _net(), loss_fn=loss, cache=tmp_path) == 3
        assert _profile_count(counted, _net(), loss_fn=loss, cache=tmp_path) == 3
    assert list(tmp_path.iterdir()) == []


def test_custom_optimizer_runs_and_stores_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    counted = Counted(monkeypatch)
    momentum = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    profile_model(_net(), input_size=(4,), cache=tmp_path, precisions=("fp32",))
    stored = sorted(tmp_path.rglob("*.pkl"))
    counted.count()
    for _ in range(2):  # a fresh profile from the cache: the callable's trace runs again
        warm = profile_model(_net(), input_size=(4,), cache=tmp_path)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            est = warm.estimate(8, optimizer=momentum)
        assert counted.count() == 1  # its optimizer trace; the timeline is a hit
        # one momentum buffer per parameter: Linear(4, 3) 4*3 + 3 = 15 and Linear(3, 2)
        # 3*2 + 2 = 8 floats, 23 * 4 bytes = 92
        assert est.optimizer_state_bytes == 92
    assert sorted(tmp_path.rglob("*.pkl")) == stored  # the callable is keyed by identity only


def test_key_is_stable_and_canonical() -> None:
    a = disk_cache.profile_key(_net(), [("[0]", torch.zeros(2, 4))], None, None, "cuda", {})
    b = disk_cache.profile_key(_net(), [("[0]", torch.zeros(2, 4))], None, None, "cuda", {})
    assert a == b
    # integer inputs' values decide mask paths; float values do not
    ids = disk_cache.profile_key(
        _net(), [("ids", torch.ones(2, 4, dtype=torch.long))], None, None, "cuda", {}
    )
    zeros = disk_cache.profile_key(
        _net(), [("ids", torch.zeros(2, 4, dtype=torch.long))], None, None, "cuda", {}
    )
    floats = disk_cache.profile_key(_net(), [("[0]", torch.ones(2, 4))], None, None, "cuda", {})
    assert ids != zeros
    assert floats == a
    # a tied weight is another model than two equal weights
    tied = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    untied = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    tied[1].weight = tied[0].weight
    args: tuple[Any, ...] = ([], (4,), None, "cuda", {})
    assert disk_cache.profile_key(tied, *args) != disk_cache.profile_key(untied, *args)


def test_call_key_follows_every_dataclass_field() -> None:
    lever = vram_widget.Levers()
    other = lever.__class__(**{**lever.__dict__, "grad_accumulation": 2})
    a = disk_cache.call_key("timeline", Precision.FP32, Mode.TRAIN, None, lever)
    b = disk_cache.call_key("timeline", Precision.FP32, Mode.TRAIN, None, other)
    assert a != b
    assert a == disk_cache.call_key(
        "timeline", Precision.FP32, Mode.TRAIN, None, vram_widget.Levers()
    )


# -- a broken cache --------------------------------------------------------------------------


def test_corrupt_entry_is_a_miss_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    counted = Counted(monkeypatch)
    eager = {"input_size": (4,), "cache": tmp_path, "precisions": ("fp32",)}
    reference = profile_model(_net(), **eager).estimate(8)
    counted.count()
    entries = sorted(tmp_path.glob("*/*.pkl"))
    assert len(entries) == 3
    for entry in entries:
        entry.write_bytes(b"not a pickle")
    with pytest.warns(CacheWarning, match="cannot be read"):
        again = profile_model(_net(), **eager).estimate(8)
    assert counted.count() == 3
    assert again.peak_bytes == reference.peak_bytes
    # the entries were written again: the next profile is a hit
    profile_model(_net(), input_size=(4,), cache=tmp_path)
    assert counted.count() == 0


def test_unwritable_directory_warns_once_and_profiles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(disk_cache, "_warned_dirs", set())
    blocker = tmp_path / "a file"
    blocker.write_text("")
    where = blocker / "cache"  # under a regular file: no directory can be made (root too)
    counted = Counted(monkeypatch)
    with pytest.warns(CacheWarning, match="cannot be cached") as caught:
        profile = profile_model(_net(), input_size=(4,), cache=where, precisions=("fp32",))
    assert len([w for w in caught if issubclass(w.category, CacheWarning)]) == 1
    assert counted.count() == 3
    assert profile.estimate(8).peak_bytes > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)  # once per directory
        profile_model(_net(), input_size=(4,), cache=where)


@pytest.mark.parametrize("how", ["keyword", "env-0", "env-off"])
def test_cache_turned_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    monkeypatch.setenv("VRAM_WIDGET_CACHE_DIR", str(tmp_path))
    kwargs: dict[str, Any] = {}
    if how == "keyword":
        kwargs["cache"] = False
    else:
        monkeypatch.setenv("VRAM_WIDGET_CACHE", how.removeprefix("env-"))
    counted = Counted(monkeypatch)
    assert _profile_count(counted, _net(), **kwargs) == 3
    assert _profile_count(counted, _net(), **kwargs) == 3
    assert list(tmp_path.iterdir()) == []


def test_show_memory_cache_false(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VRAM_WIDGET_CACHE_DIR", str(tmp_path))
    vram_widget.show_memory(_net(), input_size=(4,), cache=False)
    assert list(tmp_path.iterdir()) == []
    vram_widget.show_memory(_net(), input_size=(4,))
    assert len(list(tmp_path.glob("*/*.pkl"))) == 3


def test_bad_cache_argument() -> None:
    with pytest.raises(TypeError, match="cache must be True"):
        profile_model(_net(), input_size=(4,), cache=3)


# -- what a hit restores ---------------------------------------------------------------------


class _Unused(nn.Module):
    """A parameter the forward never uses: it gets no gradient, and no optimizer state."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 2)
        self.unused = nn.Linear(4, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def test_hit_restores_which_parameters_got_gradients() -> None:
    profile_model(_Unused(), input_size=(4,))  # stores fp32 train, inference, Adam
    warm = profile_model(_Unused(), input_size=(4,), precisions=())
    # the training step is a hit; SGD with momentum is not, and runs on what it said
    est = warm.estimate(8, optimizer="sgd-momentum")
    # one momentum buffer per parameter with a gradient: used.weight 2x4, used.bias 2,
    # 10 floats of 4 bytes = 40 bytes (unused's 5,000 floats get none)
    assert est.optimizer_state_bytes == (2 * 4 + 2) * 4


def test_stored_warnings_are_warned_on_a_hit(tmp_path: Path) -> None:
    subject = types.SimpleNamespace(fixed_dtypes=frozenset(), params_with_grad={})

    class Inner:  # the shape of profiler._Source
        profiler = types.SimpleNamespace(real=False, subject=subject)

        def timeline(self, *args: Any) -> np.ndarray:
            warnings.warn("memory is not affine in the batch size", UserWarning, stacklevel=2)
            return np.arange(3)

    with pytest.warns(UserWarning, match="not affine"):
        first = disk_cache.DiskCachedSource(Inner(), tmp_path, "k").timeline(
            Precision.FP32, Mode.TRAIN
        )
    with pytest.warns(UserWarning, match="not affine"):
        hit = disk_cache.DiskCachedSource(Inner(), tmp_path, "k").timeline(
            Precision.FP32, Mode.TRAIN
        )
    assert hit.tolist() == first.tolist() == [0, 1, 2]


# -- precisions= -----------------------------------------------------------------------------


def _assert_same_estimate(asked: Any, reference: Any) -> None:
    assert asked.peak_bytes == reference.peak_bytes
    assert dict(asked.peak_breakdown) == dict(reference.peak_breakdown)
    assert np.array_equal(asked.live_bytes, reference.live_bytes)
    assert asked.flops == reference.flops


def test_precisions_bf16_runs_no_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    counted = Counted(monkeypatch)
    profile = profile_model(_net(), input_size=(4,), precisions=("bf16",), cache=False)
    assert [args[0] for _name, args in counted.calls] == [Precision.BF16] * 3
    counted.count()
    eager = profile_model(_net(), input_size=(4,), precisions=("fp32",), cache=False)
    asked = profile.estimate(8, "bf16")
    assert counted.count() == 3  # the eager fp32 train, inference, Adam
    _assert_same_estimate(asked, eager.estimate(8, "bf16"))


def test_default_profiles_only_what_the_first_estimate_asks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counted = Counted(monkeypatch)
    model = _net()
    before = snapshot_model(model)
    profile = profile_model(model, input_size=(4,), cache=False)
    assert counted.count() == 0  # an unrecorded fake step checks it runs; nothing profiled
    asked = profile.estimate(8, "bf16", "adamw")
    # a training estimate needs the training step and the optimizer's: no fp32, no inference
    assert counted.calls == [
        ("timeline", (Precision.BF16, Mode.TRAIN)),
        ("optimizer_trace", (Precision.BF16, vram_widget.OptimizerName.ADAMW)),
    ]
    assert_model_unchanged(model, before)
    # the same answer as a profile that ran fp32 up front (as the default did before)
    eager = profile_model(_net(), input_size=(4,), precisions=("fp32",), cache=False)
    _assert_same_estimate(asked, eager.estimate(8, "bf16", "adamw"))
    _assert_same_estimate(profile.estimate(8), eager.estimate(8))


def test_show_memory_in_bf16_runs_no_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    counted = Counted(monkeypatch)
    vram_widget.show_memory(_net(), input_size=(4,), precision="bf16", cache=False)
    assert counted.calls and {args[0] for _name, args in counted.calls} == {Precision.BF16}


class _ReadsAValue(nn.Module):
    """A forward that reads a value (``.item()``): no meta tensor has one."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * (1.0 + 0.0 * float(x.sum().item() > 0))


def test_default_profiles_fp32_where_the_meta_check_cannot_tell(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counted = Counted(monkeypatch)
    with pytest.warns(UserWarning, match="fake tensors cannot run this model"):
        profile = profile_model(_ReadsAValue(), input_size=(4,), cache=False)
    # what precisions=("fp32",) profiles, at once (here through the real fallback)
    assert [name for name, _args in counted.calls] == ["timeline", "timeline", "optimizer_trace"]
    assert profile.fallback_reason is not None


def test_precisions_empty_defers_every_run(monkeypatch: pytest.MonkeyPatch) -> None:
    counted = Counted(monkeypatch)
    profile = profile_model(_net(), input_size=(4,), precisions=(), cache=False)
    assert counted.count() == 0
    profile.estimate(8, "fp16", mode="inference")
    assert counted.calls == [("timeline", (Precision.FP16, Mode.INFERENCE))]


def test_precisions_invalid() -> None:
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        profile_model(_net(), input_size=(4,), precisions=("fp8",))
    with pytest.raises(TypeError, match="precisions must be a sequence"):
        profile_model(_net(), input_size=(4,), precisions=16)


def test_lora_profile_from_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    # PEFT's adapters stay fp32 on a bf16 base: the cached bf16 answer keeps them so
    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    lora = {"lora_rank": 2, "lora_targets": ["0", "2"]}
    uncached = profile_model(model(), input_size=(8,), cache=False)
    expected = [uncached.estimate(4, p, "adamw", **lora).peak_bytes for p in ("fp32", "bf16")]
    counted = Counted(monkeypatch)
    cold = profile_model(model(), input_size=(8,))
    assert [cold.estimate(4, p, "adamw", **lora).peak_bytes for p in ("fp32", "bf16")] == expected
    assert counted.count() > 0
    warm = profile_model(model(), input_size=(8,))
    assert [warm.estimate(4, p, "adamw", **lora).peak_bytes for p in ("fp32", "bf16")] == expected
    assert counted.count() == 0


def test_compiled_step_from_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch.compile step, profiled at the asked batch (compiled.decided_at), is stored
    like any run: a fresh profile on the same cache directory runs no model for it at that
    batch; another batch is a run of its own (is_cached, in memory, says so after)."""
    import dataclasses

    settings: dict[str, Any] = {"optimizer": "sgd", "compile": True}
    expected = profile_model(_net(), input_size=(4,), cache=False).estimate(3, **settings)
    counted = Counted(monkeypatch)
    cold = profile_model(_net(), input_size=(4,), precisions=())
    est = cold.estimate(3, **settings)
    assert counted.count() > 0
    assert (est.peak_bytes, est.saved_bytes) == (expected.peak_bytes, expected.saved_bytes)
    warm = profile_model(_net(), input_size=(4,), precisions=())
    again = warm.estimate(3, **settings)
    assert counted.count() == 0  # no model run
    levers = dataclasses.replace(warm.levers(), compile="model")
    assert warm.is_cached("fp32", "train", "sgd", levers=levers, batch_size=3)
    assert not warm.is_cached("fp32", "train", "sgd", levers=levers, batch_size=4)
    assert (again.peak_bytes, again.saved_bytes) == (expected.peak_bytes, expected.saved_bytes)
    assert again.levers == est.levers and again.compile_bound == est.compile_bound
