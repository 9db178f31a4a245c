"""The widget's weights control: the ``weights`` and ``float8`` traits behind one dropdown,
each estimate the profile's own with the same keywords, a new choice profiled once behind
the busy label, and a choice the setting refuses kept back with the reason in the
headline."""

from __future__ import annotations

from typing import Any

import pytest
import traitlets

from vram_widget import profile_model, zoo
from vram_widget._display.widget import MemoryWidget
from vram_widget._display.widget_recipe import recipe_settings
from vram_widget._estimating.recipe import Recipe
from vram_widget._estimating.recipe.weights import Weights

pytestmark = pytest.mark.timeout(300)


class _SubProfileSpy:
    """Wraps a profile's source: records each quantized or float8 sub-profile it makes and
    what the widget showed while it ran (status, all controls disabled)."""

    def __init__(self, source: object, widget_ref: list[MemoryWidget]) -> None:
        self.source = source
        self.widget_ref = widget_ref
        self.made: list[tuple[str, str, bool]] = []

    def _seen(self, what: str) -> None:
        w = self.widget_ref[0] if self.widget_ref else None
        if w is not None:
            busy = all(c.disabled for c in w._control_widgets)
            self.made.append((what, str(w._status.value), busy))
        else:
            self.made.append((what, "", False))

    def quantized_profile(self, *args: Any) -> Any:
        self._seen("quantized")
        return self.source.quantized_profile(*args)  # type: ignore[attr-defined]

    def float8_profile(self, *args: Any) -> Any:
        self._seen("float8")
        return self.source.float8_profile(*args)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.source, name)


def _spied(profile: Any) -> tuple[_SubProfileSpy, list[MemoryWidget]]:
    ref: list[MemoryWidget] = []
    spy = _SubProfileSpy(profile._source, ref)
    profile._source = spy
    return spy, ref


@pytest.fixture(scope="module")
def mlp16() -> Any:
    """The zoo MLP with every Linear dim a multiple of 16 (64 -> 128 -> 128 -> 32: torchao's
    float8 matmul needs both dims of each weight divisible by 16) and its CPU profile."""
    return profile_model(
        zoo.mlp(in_features=64, hidden=(128, 128), num_classes=32), input_size=(64,), device="cpu"
    )


def test_nf4_and_int8_are_the_profiles_estimates(mlp: tuple[Any, Any]) -> None:
    profile = mlp[1]
    spy, ref = _spied(profile)
    try:
        w = MemoryWidget(profile, batch_size=4, mode="inference")
        ref.append(w)
        assert (w.weights, w.float8, w._weights_dropdown.value) == (None, None, "off")
        w._weights_dropdown.value = "nf4"  # what choosing it does
        est = profile.estimate(4, mode="inference", weights="nf4")
        assert w.weights == "nf4" and w.float8 is None
        assert w.estimate.peak_bytes == est.peak_bytes
        assert w.estimate.weights == est.weights == Weights("nf4").describe()
        assert w.estimate.to_dataframe().equals(est.to_dataframe())
        # one sub-profile, made behind the busy label with every control disabled
        assert [(what, busy) for what, _, busy in spy.made] == [("quantized", True)]
        assert "profiling" in spy.made[0][1]
        assert not any(c.disabled for c in (w._weights_dropdown, w._batch_box))
        # the details name the weights and the loaded layout of the nf4 model
        details = w.details_html
        assert "Linear4bit" in details
        assert profile.load_bytes(weights="nf4").summary().split(";")[0] in details
        # a batch move after it is numpy: no profiling, no label
        w.batch_size = 16
        assert len(spy.made) == 1 and w._status.value == ""
        assert (
            w.estimate.peak_bytes
            == profile.estimate(16, mode="inference", weights="nf4").peak_bytes
        )
        # int8: LLM.int8 without the outlier split (threshold 0), as the control asks it
        w._weights_dropdown.value = "int8"
        int8 = profile.estimate(16, mode="inference", weights=Weights("int8", int8_threshold=0.0))
        assert w.weights == "int8" and w.estimate.peak_bytes == int8.peak_bytes
        assert w.estimate.weights == int8.weights
        assert [what for what, _, _ in spy.made] == ["quantized", "quantized"]
        # back to the model's own weights: the plain profile answers, nothing profiled
        w._weights_dropdown.value = "off"
        assert w.weights is None
        assert w.estimate.peak_bytes == profile.estimate(16, mode="inference").peak_bytes
        assert len(spy.made) == 2
    finally:
        profile._source = spy.source


def test_refused_choice_is_kept_back_with_the_reason(mlp: tuple[Any, Any]) -> None:
    profile = mlp[1]
    spy, ref = _spied(profile)
    try:
        w = MemoryWidget(profile, batch_size=4)  # training
        ref.append(w)
        before = w.estimate.peak_bytes
        w._weights_dropdown.value = "int8"
        assert w.weights is None and w._weights_dropdown.value == "off"
        assert "weights=&#x27;int8&#x27; is for inference" in w.headline_html
        assert w.estimate.peak_bytes == before
        # nf4 in training without a LoRA rank: refused at once too
        w._weights_dropdown.value = "nf4"
        assert w.weights is None and "needs lora_rank" in w.headline_html
        # float8 under autocast: refused before any profiling
        w.precision = "amp-bf16"
        w._weights_dropdown.value = "float8-rowwise"
        assert w.float8 is None and w._weights_dropdown.value == "off"
        assert "autocast" in w.headline_html
        assert spy.made == []  # no sub-profile run, no busy label
    finally:
        profile._source = spy.source


def test_float8_rowwise_is_the_profiles_estimate(mlp16: Any) -> None:
    spy, ref = _spied(mlp16)
    try:
        w = MemoryWidget(mlp16, batch_size=4, optimizer="adamw")
        ref.append(w)
        w._weights_dropdown.value = "float8-rowwise"
        est = mlp16.estimate(4, optimizer="adamw", float8="rowwise")
        assert (w.weights, w.float8) == (None, "rowwise")
        assert w.estimate.peak_bytes == est.peak_bytes
        assert w.estimate.float8 == est.float8 != ""
        assert [(what, busy) for what, _, busy in spy.made] == [("float8", True)]
        w.batch_size = 8  # numpy from the float8 sub-profile
        assert len(spy.made) == 1
        assert (
            w.estimate.peak_bytes
            == mlp16.estimate(8, optimizer="adamw", float8="rowwise").peak_bytes
        )
        # the pair: nf4 clears float8, is refused in training (no LoRA rank), and both go back
        w.weights = "nf4"
        assert (w.weights, w.float8) == (None, "rowwise")
        assert w._weights_dropdown.value == "float8-rowwise"
        # float8 outside training: refused, the step kept
        w.mode = "inference"
        assert w.mode == "train" and "has no backward" in w.headline_html
        w._weights_dropdown.value = "off"
        assert w.float8 is None
        assert w.estimate.peak_bytes == mlp16.estimate(8, optimizer="adamw").peak_bytes
    finally:
        mlp16._source = spy.source


def test_trait_forms(mlp: tuple[Any, Any]) -> None:
    w = MemoryWidget(mlp[1], batch_size=2, mode="inference")
    w.weights = "off"
    assert w.weights is None
    with pytest.raises(traitlets.TraitError, match="float8='rowwise'"):
        w.weights = "float8-rowwise"
    with pytest.raises(traitlets.TraitError, match="valid values are None, 'int8'"):
        w.weights = "int3"
    with pytest.raises(traitlets.TraitError, match="unknown float8 recipe"):
        w.float8 = "blockwise"


def test_recipe_weights_start_the_control() -> None:
    s = recipe_settings(
        Recipe().with_(precision="bf16", weights=Weights("nf4", compute_dtype="bf16"))
    )
    assert dict(s.controls) == {"precision": "bf16", "weights": "nf4"} and not s.fixed
    s = recipe_settings(Recipe().with_(float8=True))
    assert dict(s.controls) == {"float8": "tensorwise"}
    # a Weights no choice is (its own block size) is held as the Recipe gives it
    odd = Weights("nf4", blocksize=128)
    s = recipe_settings(Recipe().with_(weights=odd))
    assert dict(s.fixed) == {"weights": odd} and "weights" not in s.controls
