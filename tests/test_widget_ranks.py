"""Expert and context parallelism in the widget: the ep and cp controls, the world size that
follows them, the rank's estimate in the figure and the details, the rules that show or
hide each control, and the refusals (a model without experts, a combination the estimate
does not take) shown in the headline; each new question with ep or cp > 1 profiles one
rank, behind the label."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import traitlets

from vram_widget import profile_model, show_memory
from vram_widget._display.figures import TRACE_NAMES
from vram_widget._display.widget import MemoryWidget
from vram_widget._display.widget_recipe import recipe_settings
from vram_widget._estimating.recipe import Recipe

pytestmark = pytest.mark.timeout(300)

PEAK = TRACE_NAMES.index("peak")


class _RankSpy:
    """Wraps a profile's source: records each rank's sub-profile run (a question not asked
    before) and what the widget showed while it ran; everything else passes through."""

    def __init__(self, source: object) -> None:
        self.source = source
        self.asked: list[tuple[Any, ...]] = []
        self.seen: list[tuple[str, bool]] = []  # (status html, all controls disabled)
        self.widget: MemoryWidget | None = None

    def _asked(self, key: tuple[Any, ...]) -> None:
        if key not in self.asked and self.widget is not None:
            w = self.widget
            self.seen.append((str(w._status.value), all(c.disabled for c in w._control_widgets)))
        if key not in self.asked:
            self.asked.append(key)

    def expert_parallel_estimate(self, ep: int, recipe: Any) -> Any:
        self._asked(("ep", ep, recipe))
        return self.source.expert_parallel_estimate(ep, recipe)  # type: ignore[attr-defined]

    def context_parallel_estimate(self, cp: int, seq_len: int, recipe: Any) -> Any:
        self._asked(("cp", cp, seq_len, recipe))
        return self.source.context_parallel_estimate(cp, seq_len, recipe)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.source, name)


def _spied(profile: Any) -> _RankSpy:
    spy = _RankSpy(profile._source)
    profile._source = spy
    return spy


def test_ep_control_estimates_one_rank_and_refuses_other_layouts() -> None:
    pytest.importorskip("transformers")
    from models import hf_mixtral, hf_tokens

    torch.manual_seed(0)
    # () profiles nothing up front: the widget's first estimate (inference) profiles it
    profile = profile_model(hf_mixtral(), inputs=hf_tokens(2), device="cpu", precisions=())
    spy = _spied(profile)
    w = MemoryWidget(profile, batch_size=4, mode="inference")
    spy.widget = w
    dropdown = w._ep_dropdown
    assert dropdown in w.control_groups["GPUs"] and dropdown.layout.display is None
    # the rank counts up to 64 that divide the model's 4 experts: 1, 2 and 4
    assert list(dropdown.options) == [1, 2, 4]
    # a CPU profile cannot run ring attention: cp is off (and hidden outside training)
    assert w._cp_dropdown.disabled and w._cp_dropdown.layout.display == "none"
    assert "not available: cp > 1 is estimated for device='cuda'" in w._cp_dropdown.tooltip

    dropdown.value = 2  # the control writes the trait; GPUs follow: the ep ranks' world
    assert (w.ep, w.gpus, w.estimate.ep, w.estimate.gpus) == (2, 2, 2, 2)
    assert len(spy.seen) == 1 and "profiling fp32 / inference / 16 tokens / ep=2" in spy.seen[0][0]
    assert spy.seen[0][1]  # every control disabled while the rank was profiled
    assert "profiled fp32 / inference" in w._status.value
    # the recipe of the widget's setting, and the same question asked directly: no new run
    asked_recipe = Recipe.from_keywords(None, batch_size=4, **w._settings())
    assert (asked_recipe.parallel.ep, asked_recipe.parallel.gpus) == (2, 2)
    cc = w.target.compute_capability
    asked = profile.estimate(4, mode="inference", seq_len=16, gpus=2, ep=2, compute_capability=cc)
    assert len(spy.asked) == 1
    assert w.figure.data[PEAK].y[0] == asked.peak_bytes == w.estimate.peak_bytes
    # each rank keeps 2 of the 4 experts: gate_up_proj 4 x 256 x 64 and down_proj 4 x 64 x
    # 128 parameters a layer, half of them (49,152) fewer, 2 layers, 4 B each: 393,216 B
    whole = profile.estimate(4, mode="inference", seq_len=16, compute_capability=cc)
    assert whole.parameter_bytes - w.estimate.parameter_bytes == 393_216
    assert "rank 0 of ep=2, tokens routed evenly" in w.figure.layout.title.text
    summary = w.summary_html
    assert "<th>Expert parallel</th><td>2 ranks share one batch of 4" in summary
    assert "largest batch not searched with ep &gt; 1" in summary
    assert "Data parallel" not in summary and "GPUs needed" not in summary

    # a combination the estimate does not take: refused at once, the setting kept
    w._tp_dropdown.value = 2
    assert w.tp == 1 and w._tp_dropdown.value == 1 and len(spy.seen) == 1
    assert "ep=2 with tp=2: experts split over tensor-parallel ranks" in w.headline_html
    assert "kept tp = 1" in w.headline_html
    w._strategy_dropdown.value = "zero2"
    assert w.strategy == w._strategy_dropdown.value == "ddp" and len(spy.seen) == 1
    assert "ep=2 with strategy='zero2'" in w.headline_html.replace("&#x27;", "'")
    assert w.figure.data[PEAK].y[0] == asked.peak_bytes

    dropdown.value = 1  # GPUs back to one; the figure is the whole model's again
    assert (w.ep, w.gpus, w.estimate.ep) == (1, 1, 1) and w.headline.error == ""
    assert w.figure.data[PEAK].y[0] == whole.peak_bytes
    assert "ep=" not in w.figure.layout.title.text and len(spy.seen) == 1


def test_ep_and_cp_hidden_and_refused_for_a_model_without_them(mlp: tuple[Any, Any]) -> None:
    w = MemoryWidget(mlp[1], batch_size=4)
    # no experts and no sequence axis: both controls hidden, ep offering 1 alone
    assert w._ep_dropdown.layout.display == "none" and list(w._ep_dropdown.options) == [1]
    assert w._cp_dropdown.layout.display == "none"
    with pytest.raises(traitlets.TraitError, match=r"ep=2: Sequential has no experts to split"):
        w.ep = 2
    w._set_from_control("ep", 2)  # what a control's value would do: kept, and said why
    assert (w.ep, w.gpus) == (1, 1)
    assert "ep = 2 refused: ep=2: Sequential has no experts" in w.headline_html
    with pytest.raises(traitlets.TraitError, match=r"cp > 1 is estimated for device='cuda'"):
        w.cp = 2


def test_rank_settings_checked_before_profiling_and_read_from_a_recipe() -> None:
    # an object that is no model: profiling it would fail; the forms are refused first
    with pytest.raises(ValueError, match=r"ep=0; give a whole number of ranks >= 1"):
        show_memory(object(), input_size=(4,), ep=0)
    with pytest.raises(ValueError, match=r"cp=2 with gpus=4: the cp ranks share one batch"):
        show_memory(object(), input_size=(4,), cp=2, gpus=4)
    with pytest.raises(ValueError, match=r"ep=2 with pp=2"):
        show_memory(object(), input_size=(4,), ep=2, pp=2)
    with pytest.raises(ValueError, match=r"stages_per_rank=0; give a whole number >= 2"):
        show_memory(object(), input_size=(4,), pp=2, stages_per_rank=0)
    settings = recipe_settings(Recipe().with_(gpus=2, ep=2))
    assert dict(settings.controls) == {"gpus": 2, "ep": 2} and dict(settings.fixed) == {}
    settings = recipe_settings(
        Recipe().with_(gpus=2, pp=2, pp_schedule="interleaved-1f1b", stages_per_rank=3)
    )
    assert dict(settings.controls)["stages_per_rank"] == 3


def test_cp_control_estimates_one_rank_unconfirmed() -> None:
    pytest.importorskip("transformers")
    from models import hf_llama, hf_tokens

    torch.manual_seed(0)
    profile = profile_model(hf_llama(), inputs=hf_tokens(2), device="cuda", precisions=())
    spy = _spied(profile)
    # bf16: the ring runs the flash kernel CUDA picks for it
    w = MemoryWidget(profile, batch_size=2, precision="bf16")
    spy.widget = w
    dropdown = w._cp_dropdown
    assert dropdown in w.control_groups["GPUs"] and not dropdown.disabled
    assert dropdown.layout.display is None  # training, with a sequence axis
    assert list(dropdown.options) == [1, 2, 4, 8]  # those that divide the 16 tokens
    assert w._ep_dropdown.layout.display == "none"  # a dense Llama

    dropdown.value = 2
    assert (w.cp, w.gpus, w.estimate.cp, w.estimate.seq_len) == (2, 2, 2, 16)
    assert len(spy.seen) == 1 and "cp=2" in spy.seen[0][0] and spy.seen[0][1]
    cc = w.target.compute_capability
    asked = profile.estimate(2, "bf16", seq_len=16, gpus=2, cp=2, compute_capability=cc)
    assert len(spy.asked) == 1  # the widget's question: answered from memory
    assert w.figure.data[PEAK].y[0] == asked.peak_bytes == w.estimate.peak_bytes
    title = w.figure.layout.title.text
    assert "rank 0 of cp=2, 8 of 16 tokens a sequence (UNCONFIRMED)" in title
    summary = w.summary_html
    assert "<th>Context parallel</th><td>2 ranks share one batch of 2, each holding 8" in summary
    assert "UNCONFIRMED against a real CUDA run" in summary

    # a length cp does not divide: refused before any run, the length kept
    w.seq_len = 15
    assert w.seq_len == 16 and len(spy.seen) == 1
    assert "cp=2 with seq_len=15: each rank holds seq_len / cp tokens" in w.headline_html
    dropdown.value = 1
    assert (w.cp, w.gpus, w.estimate.cp) == (1, 1, 1)
    w.mode = "inference"  # cp shows in training only
    assert dropdown.layout.display == "none"
