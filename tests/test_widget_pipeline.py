"""Pipeline parallelism in the widget: the pp, schedule and micro-batch controls, the world
size that follows pp, the per-stage panel of the figure, and the refusals shown in the
headline; each new question with pp > 1 profiles every stage, behind the label."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from vram_widget import profile_model, show_memory, zoo
from vram_widget._display.figure_stages import STAGE_TRACE_NAMES
from vram_widget._display.figures import TRACE_NAMES
from vram_widget._display.widget import MemoryWidget
from vram_widget._display.widget_recipe import recipe_settings
from vram_widget._estimating.estimator import MemoryEstimate
from vram_widget._estimating.recipe import Recipe

pytestmark = pytest.mark.timeout(300)

STAGES = TRACE_NAMES.index(STAGE_TRACE_NAMES[0])
WORST = TRACE_NAMES.index(STAGE_TRACE_NAMES[2])


class _StageSpy:
    """Wraps a profile's source: records each new stages' run (a question not asked
    before) and what the widget showed while it ran; everything else passes through."""

    def __init__(self, source: object) -> None:
        self.source = source
        self.asked: set[tuple[Any, ...]] = set()
        self.seen: list[tuple[str, bool]] = []  # (status html, all controls disabled)
        self.widget: MemoryWidget | None = None

    def pipeline_stage_peaks(self, *args: Any) -> Any:
        if args not in self.asked and self.widget is not None:
            w = self.widget
            self.seen.append((str(w._status.value), all(c.disabled for c in w._control_widgets)))
        self.asked.add(args)
        return self.source.pipeline_stage_peaks(*args)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.source, name)


def _same_estimate(shown: MemoryEstimate, asked: MemoryEstimate) -> bool:
    """The fields a pipeline estimate sets, and the rest's headline numbers."""
    fields = (
        "peak_bytes", "total_bytes", "parameter_bytes", "stage_peak_bytes",
        "stage_resident_bytes", "gpus", "pp", "pp_schedule", "microbatches", "batch_size",
        "flops",
    )  # fmt: skip
    return all(getattr(shown, f) == getattr(asked, f) for f in fields)


@pytest.fixture(scope="module")
def llama_profile() -> Any:
    pytest.importorskip("transformers")
    from models import hf_llama, hf_tokens

    torch.manual_seed(0)
    return profile_model(hf_llama(), inputs=hf_tokens(2), device="cpu")


def test_pipeline_controls_estimate_and_stage_bars(llama_profile: Any) -> None:
    profile = llama_profile
    spy = _StageSpy(profile._source)
    profile._source = spy  # type: ignore[assignment]
    w = MemoryWidget(profile, batch_size=4, optimizer="adamw", gpus=8)
    spy.widget = w
    dropdown = w._pp_dropdown
    assert dropdown in w.control_groups["GPUs"] and not dropdown.disabled
    # the Llama has 2 decoder layers: 4 and 8 stages do not divide them
    assert list(dropdown.options) == [1, 2]
    assert w._schedule_dropdown.layout.display == "none"  # shown with pp > 1
    assert not w.figure.data[STAGES].visible

    dropdown.value = 2  # the control writes the trait; GPUs follow: pp x tp = 2 x 1
    assert (w.pp, w.gpus, w.estimate.pp) == (2, 2, 2)
    assert len(spy.seen) == 1 and "profiling fp32 / train / adamw" in spy.seen[0][0]
    assert "pp=2 gpipe x 2" in spy.seen[0][0] and spy.seen[0][1]  # label up, controls off
    assert "profiled fp32 / train" in w._status.value
    assert w._schedule_dropdown.layout.display is None
    cc = w.target.compute_capability
    # the widget's settings: its sequence length (the example's 16) and card given
    same = {"optimizer": "adamw", "seq_len": 16, "gpus": 2, "pp": 2, "compute_capability": cc}
    asked = profile.estimate(4, **same)
    assert _same_estimate(w.estimate, asked)
    # the stage panel: one bar per stage's peak, the worst starred
    peaks = asked.stage_peak_bytes
    assert len(peaks) == 2 and w.figure.data[STAGES].visible
    assert list(w.figure.data[STAGES].y) == list(peaks)
    assert list(w.figure.data[WORST].x) == [int(np.argmax(peaks))]
    assert list(w.figure.data[WORST].y) == [max(peaks)] == [w.estimate.peak_bytes]
    summary = w.summary_html
    assert "largest batch not searched with pp &gt; 1" in summary
    assert "<th>Pipeline stages</th>" in summary and "Data parallel" not in summary

    # each batch is a run of its own; one asked before is answered from memory, and a
    # move that never profiles (the grouping depth) runs nothing
    w.batch_size = 8
    assert len(spy.seen) == 2 and spy.seen[1][1]
    w.batch_size = 4
    w.depth = 2
    assert len(spy.seen) == 2 and "profil" not in w._status.value
    assert list(w.figure.data[STAGES].y) == list(peaks)

    # refused before any run: the headline says why, the setting goes back
    w._microbatch_dropdown.value = 8
    assert w.microbatches is None and w._microbatch_dropdown.value == 0
    assert "batch_size=4 is not split evenly into microbatches=8" in w.headline_html
    assert "kept microbatches = None" in w.headline_html
    assert len(spy.seen) == 2 and list(w.figure.data[STAGES].y) == list(peaks)

    w._schedule_dropdown.value = "1f1b"  # a new question: one run
    assert w.estimate.pp_schedule == "1f1b" and len(spy.seen) == 3
    one_f = profile.estimate(4, **same, pp_schedule="1f1b")
    assert _same_estimate(w.estimate, one_f)
    assert list(w.figure.data[STAGES].y) == list(one_f.stage_peak_bytes)
    w.microbatches = 1  # Schedule1F1B needs a micro-batch a stage
    assert w.microbatches is None and len(spy.seen) == 3
    assert "pp_schedule=&#x27;1f1b&#x27; with microbatches=1 &lt; pp=2" in w.headline_html
    w.gpus = 4  # dp x pp ranks are FSDP2's only (strategy zero2 or zero3)
    assert w.gpus == 2 and "pp=2 on gpus=4 with strategy=&#x27;ddp&#x27;" in w.headline_html
    # ScheduleInterleaved1F1B, 2 stages a rank: a new question, one run; a bar a rank
    assert list(w._schedule_dropdown.options) == ["gpipe", "1f1b", "interleaved-1f1b"]
    w._schedule_dropdown.value = "interleaved-1f1b"
    interleaved = profile.estimate(4, **same, pp_schedule="interleaved-1f1b")
    assert _same_estimate(w.estimate, interleaved) and w.estimate.stages_per_rank == 2
    assert list(w.figure.data[STAGES].y) == list(interleaved.stage_peak_bytes)
    assert list(w.figure.layout.xaxis3.ticktext) == ["rank 0", "rank 1"]
    assert len(spy.seen) == 4
    # the stages a rank, shown under interleaved-1f1b, offering what the layers split
    # into: torchtitan counts 2 layers + embedding + head = 4, so 2 ranks x 2 stages fit
    # and 2 x 3 = 6 stages do not
    stages = w._stages_dropdown
    assert stages in w.control_groups["GPUs"] and stages.layout.display is None
    assert list(stages.options) == [("= 2", 0), ("2", 2)]
    stages.value = 2  # the default's count: the same stages, answered from memory
    assert (w.stages_per_rank, w.estimate.stages_per_rank) == (2, 2)
    assert Recipe.from_keywords(None, **w._settings()).parallel.stages_per_rank == 2
    assert "profil" not in w._status.value and len(spy.seen) == 4
    assert list(w.figure.data[STAGES].y) == list(interleaved.stage_peak_bytes)
    w.stages_per_rank = None
    w._set_from_control("stages_per_rank", 3)  # a count the layers refuse: kept
    assert w.stages_per_rank is None and len(spy.seen) == 4
    assert "6 pipeline stages need at least 4 decoder layers" in w.headline_html
    w.stages_per_rank = 2
    w._schedule_dropdown.value = "gpipe"  # asked before; the stages a rank back to default
    assert (w.stages_per_rank, w.estimate.stages_per_rank) == (None, 1)
    assert stages.layout.display == "none" and len(spy.seen) == 4

    w.pp = 1  # GPUs back to tp; the panel hidden, the waterfall whole again
    assert (w.gpus, w.estimate.pp, w.estimate.stage_peak_bytes) == (1, 1, ())
    assert not w.figure.data[STAGES].visible and list(w.figure.data[STAGES].y) == []
    assert w.headline.error == "" and len(spy.seen) == 4
    assert w._schedule_dropdown.layout.display == "none"
    # pp given at the start: GPUs follow as the control sets them; the figure is built
    # with the stage panel (the question asked before: no run)
    spy.widget = None
    started = MemoryWidget(profile, batch_size=4, optimizer="adamw", pp=2)
    assert started.gpus == 2 and list(started.figure.data[STAGES].y) == list(peaks)
    assert len(spy.asked) == 4
    profile._source = spy.source


def test_data_parallel_ranks_over_stages_in_the_widget(llama_profile: Any) -> None:
    # gpus = dp x pp: FSDP2 over each stage's dp ranks (zero2 / zero3); the widget keeps dp
    # when pp moves, its GPUs control steps in multiples of pp, and the layouts the
    # estimate refuses over stages are shown as its refusal, the setting kept
    profile = llama_profile
    w = MemoryWidget(profile, batch_size=4, optimizer="adamw", strategy="zero2", gpus=2)
    w._pp_dropdown.value = 2  # dp = 2 / 1 = 2 kept: gpus = 2 x 2
    assert (w.gpus, w.estimate.gpus, w.estimate.pp, w.estimate.strategy) == (4, 4, 2, "zero2")
    same = {"optimizer": "adamw", "seq_len": 16, "gpus": 4, "pp": 2, "strategy": "zero2",
            "compute_capability": w.target.compute_capability}  # fmt: skip
    asked = profile.estimate(4, **same)
    assert _same_estimate(w.estimate, asked) and w.headline.error == ""
    assert "profiled fp32 / train / adamw / 16 tokens / dp=2 zero2 x pp=2 gpipe x 2" in (
        w._status.value
    )
    assert list(w.figure.data[STAGES].y) == list(asked.stage_peak_bytes)
    # the layout in the stage panel's axis, the title and the details: 2 ranks a stage,
    # each running the batch of 4, so the global batch is 2 x 4 = 8
    assert w.figure.layout.xaxis3.title.text == "dp=2 x pp=2 (zero2), gpipe, 2 micro-batches"
    assert "(worst stage; dp=2 x pp=2 (zero2))" in w.figure.layout.title.text
    summary = w.summary_html
    assert "2 stages on 4 GPUs, dp=2 x pp=2 (zero2): each stage's 2 data-parallel" in summary
    assert "(global batch 2 x 4 = 8)" in summary

    # the GPUs slider one step down (2^1.75 = 3.4 GPUs) goes to the next multiple of pp
    # below, 2: dp = 1 leaves zero2 nothing to shard over, refused; GPUs and slider kept
    w._gpus_slider.value = 2**1.75
    assert (w.gpus, w._gpus_slider.value, w._gpus_box.value) == (4, 4.0, 4)
    assert "no data-parallel ranks to shard over" in w.headline_html
    assert "kept gpus = 4" in w.headline_html
    # refused over stages by name, each kept: ddp and zero1
    w._strategy_dropdown.value = "ddp"
    assert (w.strategy, w._strategy_dropdown.value) == ("zero2", "zero2")
    assert "DistributedDataParallel over stages is not estimated yet" in w.headline_html
    w._strategy_dropdown.value = "zero1"
    assert (w.strategy, w._strategy_dropdown.value) == ("zero2", "zero2")
    assert "ZeroRedundancyOptimizer over stages is not estimated yet" in w.headline_html

    # pp back to 1 keeps dp = 2 (gpus = 2), and to 2 again (answered from memory)
    w.pp = 1
    assert (w.gpus, w.estimate.gpus, w.estimate.pp, w.headline.error) == (2, 2, 1, "")
    w.pp = 2
    assert (w.gpus, w.estimate.stage_peak_bytes) == (4, asked.stage_peak_bytes)
    assert "profil" not in w._status.value
    # under ddp, dp is not kept: pp alone (gpus = pp), as before
    w.pp = 1
    w.strategy = "ddp"
    w.gpus = 8
    w.pp = 2
    assert (w.gpus, w.estimate.gpus, w.estimate.pp) == (2, 2, 2)
    # the slider one step up from 2 (2^1.25 = 2.4) goes to 4, which ddp is refused; one
    # step down (2^0.75 = 1.7) has no multiple of pp below 2: no move, the slider shown at 2
    w._gpus_slider.value = 2**1.25
    assert (w.gpus, w._gpus_slider.value) == (2, 2.0)
    assert "pp=2 on gpus=4 with strategy=&#x27;ddp&#x27;" in w.headline_html
    w._gpus_slider.value = 2**0.75
    assert (w.gpus, w._gpus_slider.value, w._gpus_box.value) == (2, 2.0, 2)


def test_pp_control_off_where_the_model_has_no_decoder() -> None:
    profile = profile_model(zoo.mlp(hidden=(16,)), input_size=(784,), device="cpu")
    w = MemoryWidget(profile, batch_size=4)
    assert w._pp_dropdown.disabled and list(w._pp_dropdown.options) == [1]
    assert "not available: pp > 1 splits a Hugging Face decoder" in w._pp_dropdown.tooltip
    w.batch_size = 5  # a move re-enables the controls, but this one
    assert w._pp_dropdown.disabled and not w._batch_slider.disabled


def test_pipeline_settings_checked_before_profiling_and_read_from_a_recipe() -> None:
    # an object that is no model: profiling it would fail; the forms are refused first
    with pytest.raises(ValueError, match=r"pp=3; the widget offers pp in \(1, 2, 4, 8\)"):
        show_memory(object(), input_size=(4,), pp=3)
    with pytest.raises(ValueError, match=r"pp_schedule='zigzag'; .* 'gpipe' or '1f1b'"):
        show_memory(object(), input_size=(4,), pp=2, pp_schedule="zigzag")
    with pytest.raises(ValueError, match=r"microbatches=0; give a whole number >= 1"):
        show_memory(object(), input_size=(4,), pp=2, microbatches=0)
    settings = recipe_settings(Recipe().with_(gpus=2, pp=2, pp_schedule="1f1b", microbatches=4))
    assert dict(settings.controls) == {
        "gpus": 2, "pp": 2, "pp_schedule": "1f1b", "microbatches": 4,
    }  # fmt: skip
    assert dict(settings.fixed) == {}
