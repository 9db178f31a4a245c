"""The widget: traits drive it, numbers shown equal estimate()'s, no torch on the update path."""

from __future__ import annotations

import asyncio
import base64
import html
import io
import re
from typing import Any

import ipywidgets as widgets
import numpy as np
import pandas as pd
import pytest
import torch
import traitlets
from torch import nn

from vram_widget import MemoryEstimate, profile_model, show_memory, zoo
from vram_widget._display.figures import TRACE_NAMES
from vram_widget._display.optimizer_control import split_choice
from vram_widget._display.widget import MemoryWidget, format_bytes
from vram_widget._display.widget_summary import AT_REST_DELAY_S
from vram_widget._estimating.gpus import GPUS, resolve_gpu
from vram_widget._estimating.levers import NO_LEVERS
from vram_widget._estimating.profile import ModelProfile
from vram_widget._estimating.sharding import resolve_parallel

GIB = 2**30
PEAK = TRACE_NAMES.index("peak")


@pytest.fixture(scope="module")
def profile() -> ModelProfile:
    return profile_model(zoo.mlp(), input_size=(784,), device="cpu")


def test_show_memory_returns_widget() -> None:
    w = show_memory(zoo.mlp(hidden=(32,)), input_size=(784,), device="cpu", batch_size=64)
    assert isinstance(w, MemoryWidget)
    assert isinstance(w, widgets.VBox)
    assert w.batch_size == 64
    assert isinstance(w.estimate, MemoryEstimate)
    assert w.estimate.batch_size == 64


def test_traits_drive_estimate_figure_and_summary(profile: ModelProfile) -> None:
    w = MemoryWidget(profile, gpu="A100 80GB")
    settings = [
        {"batch_size": 1},
        {"batch_size": 4096},
        {"optimizer": "sgd"},
        {"optimizer": None},
        {"mode": "inference"},
        {"mode": "train", "optimizer": "adam", "batch_size": 100},
        {"depth": 0},
        {"depth": 3},
    ]
    seen_peaks = set()
    for change in settings:
        before = w.summary_html
        for name, value in change.items():
            setattr(w, name, value)
        opt = None if w.optimizer == "none" else w.optimizer
        expected = profile.estimate(w.batch_size, w.precision, opt, w.mode)
        est = w.estimate
        assert est.peak_bytes == expected.peak_bytes
        assert est.total_bytes == expected.total_bytes
        assert est.flops == expected.flops
        assert w.figure.data[PEAK].y[0] == expected.peak_bytes
        assert format_bytes(expected.peak_bytes) in w.summary_html
        assert f"{expected.peak_bytes:,} B" in w.summary_html
        if "depth" not in change:
            assert w.summary_html != before
        seen_peaks.add(est.peak_bytes)
    assert len(seen_peaks) >= 4


def test_controls_and_traits_agree(profile: ModelProfile) -> None:
    w = MemoryWidget(profile)
    w._batch_slider.value = 256.0
    assert w.batch_size == 256
    w._batch_box.value = 12345  # beyond the slider: the box is exact
    assert w.batch_size == 12345
    assert w._batch_slider.value == 8192
    w.batch_size = 3
    assert w._batch_box.value == 3 and w._batch_slider.value == 3
    w.gpu = "custom"
    w.custom_gib = 2.0
    assert w.target.memory_bytes == 2 * GIB
    assert w.figure.data[TRACE_NAMES.index("capacity")].y[0] == 2 * GIB


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("batch_size", 0),
        ("batch_size", -3),
        ("batch_size", 2.5),
        ("precision", "fp8"),
        ("optimizer", "lion"),
        ("mode", "eval"),
        ("gpu", "TPU v5"),
        ("depth", -1),
        ("batch_size", 2**40 + 1),
        ("custom_gib", 0.0),
        ("custom_gib", -8.0),
        ("custom_gib", float("nan")),
        ("custom_gib", float("inf")),
        ("custom_gib", 0.0005),  # below 1 MiB
    ],
)
def test_invalid_values_refused(profile: ModelProfile, name: str, value: object) -> None:
    w = MemoryWidget(profile)
    before = w.estimate
    with pytest.raises(traitlets.TraitError):
        setattr(w, name, value)
    assert w.estimate is before


@pytest.mark.parametrize(
    ("gpu", "expected_gpu", "expected_gib"),
    [
        ("a100 80gb", "A100 80GB", None),  # catalog names, case and spaces ignored
        ("80GiB", "custom", 80.0),
        ("24 GB", "custom", 24e9 / GIB),  # SI: 24 * 10**9 bytes
        (16 * GIB, "custom", 16.0),  # bytes
    ],
)
def test_gpu_setting_takes_every_capacity_form(
    profile: ModelProfile, gpu: object, expected_gpu: str, expected_gib: float | None
) -> None:
    w = MemoryWidget(profile, gpu=gpu)
    assert w.gpu == expected_gpu
    if expected_gib is not None:
        assert w.custom_gib == pytest.approx(expected_gib)
        assert w.target.memory_bytes == round(expected_gib * GIB)
    assert format_bytes(w.target.memory_bytes) in w.summary_html


@pytest.mark.parametrize("gpu", [80, "80", "TPU v5", 2.5, "A100"])
def test_gpu_setting_that_is_not_a_capacity_raises(gpu: object) -> None:
    # raised, in a script as in a notebook, naming the valid forms
    with pytest.raises(ValueError, match=r"capacit[^$]*'80GiB'"):
        show_memory(zoo.mlp(hidden=(8,)), input_size=(784,), device="cpu", gpu=gpu)


def test_fits_and_largest_batch(profile: ModelProfile) -> None:
    w = MemoryWidget(profile, gpu="custom", custom_gib=0.25)
    largest = w.largest_batch()
    assert largest == profile.max_batch_size(GIB // 4, "fp32", "adam", "train")
    assert largest > 1
    w.batch_size = largest
    assert "<b>fits</b>" in w.headline_html and w.headline.fits is True
    w.batch_size = largest * 4
    assert "does not fit" in w.headline_html and w.headline.fits is False
    assert f"largest batch <b>{largest:,}</b>" in w.headline_html
    assert w.headline.largest_batch == largest
    w.custom_gib = 0.001  # 1 MiB: not even the parameters fit
    assert "not even batch size 1 fits" in w.headline_html


def test_summary_step_time(profile: ModelProfile) -> None:
    w = MemoryWidget(profile, gpu="A100 80GB", batch_size=256)
    rate = GPUS["A100 80GB"].peak_flops_per_s("fp32")
    assert rate is not None
    assert "19.5 TFLOP/s" in w.summary_html
    assert f"{256 / (w.estimate.flops / rate):,.0f} samples/s" in w.summary_html


def test_no_torch_on_update_path(monkeypatch: pytest.MonkeyPatch) -> None:
    model = zoo.mlp(hidden=(64, 32))
    profile = profile_model(model, input_size=(784,), device="cpu")
    for precision in ("fp32", "bf16"):
        for optimizer in ("adam", "sgd"):
            profile.estimate(2, precision, optimizer, "train")
        profile.estimate(2, precision, None, "inference")
    w = MemoryWidget(profile)

    class Refuse:
        def __getattr__(self, name: str) -> object:
            raise AssertionError(f"the update path asked the profiler for {name}")

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("torch was called on the update path")

    monkeypatch.setattr(profile, "_source", Refuse())
    monkeypatch.setattr(model, "forward", refuse)
    for fn in ("empty", "zeros", "ones", "randn", "tensor", "as_tensor"):
        monkeypatch.setattr(torch, fn, refuse)
    peaks = []
    for name, value in [
        ("batch_size", 1),
        ("batch_size", 8192),
        ("precision", "bf16"),
        ("optimizer", "sgd"),
        ("optimizer", "none"),
        ("mode", "inference"),
        ("mode", "train"),
        ("optimizer", "adam"),
        ("precision", "fp32"),
        ("gpu", "T4 16GB"),
        ("gpu", "custom"),
        ("custom_gib", 3.5),
        ("depth", 0),
        ("depth", 2),
    ]:
        setattr(w, name, value)
        assert w.figure.data[PEAK].y[0] == w.estimate.peak_bytes
        peaks.append(w.estimate.peak_bytes)
    assert w._status.value == ""
    assert len(set(peaks)) > 3


class _Spy:
    """Wraps a profile's source: records what the widget showed while each run was going."""

    def __init__(self, source: object, fail_on: str | None = None) -> None:
        self.source = source
        self.fail_on = fail_on
        self.seen: list[tuple[str, str, bool]] = []  # (run, status html, all controls disabled)
        self.widget: MemoryWidget | None = None

    def _record(self, run: str) -> None:
        w = self.widget
        if w is not None:
            busy = all(c.disabled for c in w._control_widgets)
            self.seen.append((run, str(w._status.value), busy))

    def timeline(self, precision: object, mode: object, *rest: object) -> object:
        self._record(f"timeline {precision} {mode}")
        if self.fail_on is not None and str(getattr(precision, "value", "")) == self.fail_on:
            raise RuntimeError(f"no kernel for {self.fail_on}")
        return self.source.timeline(precision, mode, *rest)  # type: ignore[attr-defined]

    def optimizer_trace(self, precision: object, optimizer: object, *rest: object) -> object:
        self._record(f"optimizer {precision} {optimizer}")
        return self.source.optimizer_trace(precision, optimizer, *rest)  # type: ignore[attr-defined]

    def load_layout(self, *args: object) -> object:
        # read from a meta build of the model, not a run: not recorded
        return self.source.load_layout(*args)  # type: ignore[attr-defined]

    def tensor_parallel_estimate(self, tp: int, *rest: object) -> object:
        if not self.tensor_parallel_cached(tp, *rest):  # a run, not an answer kept
            self._record(f"tp={tp}")
        return self.source.tensor_parallel_estimate(tp, *rest)  # type: ignore[attr-defined]

    def tensor_parallel_cached(self, *args: object) -> bool:
        return bool(self.source.tensor_parallel_cached(*args))  # type: ignore[attr-defined]

    def tensor_parallel_refusal(self, tp: int) -> object:
        return self.source.tensor_parallel_refusal(tp)  # type: ignore[attr-defined]

    def pipeline_parallel_refusal(self, pp: int, *rest: int) -> object:
        return self.source.pipeline_parallel_refusal(pp, *rest)  # type: ignore[attr-defined]

    def expert_parallel_refusal(self, ep: int) -> object:
        return self.source.expert_parallel_refusal(ep)  # type: ignore[attr-defined]

    def context_parallel_refusal(self) -> object:
        return self.source.context_parallel_refusal()  # type: ignore[attr-defined]


def _usable(w: MemoryWidget) -> bool:
    """Every control enabled (the custom-GiB box only while the custom GPU is chosen, the
    optimizer's implementation only for an optimizer that has several, the loss chunks only
    for a model that can be chunked, the offloading only on a CUDA profile, the compile
    budget only with compile on, tp, pp and cp only where the model can take them)."""
    implementation = w._optimizer_controls.implementation
    conditional = (
        w._custom_box,
        implementation,
        w._chunks_dropdown,
        w._offload_dropdown,
        w._budget_dropdown,
        w._tp_dropdown,
        w._pp_dropdown,
        w._cp_dropdown,
    )
    implementations = w._optimizer_controls.groups.get(split_choice(w.optimizer)[0])
    return (
        all(not c.disabled for c in w._control_widgets if c not in conditional)
        and w._custom_box.disabled == (w.gpu != "custom")
        and implementation.disabled == (not implementations)
        and w._chunks_dropdown.disabled == bool(w.profile.loss_chunks_refusal)
        and w._offload_dropdown.disabled == (w.profile.device.value != "cuda")
        and w._budget_dropdown.disabled == (w.compile == "off")
        and w._tp_dropdown.disabled == bool(w.profile.tensor_parallel_refusal(2))
        and w._pp_dropdown.disabled == bool(w._pp_refusal)
        and w._cp_dropdown.disabled == bool(w.profile.context_parallel_refusal())
    )


def test_new_precision_profiles_once_behind_a_progress_label() -> None:
    profile = profile_model(zoo.mlp(hidden=(64,)), input_size=(784,), device="cpu")
    spy = _Spy(profile._source)
    profile._source = spy  # type: ignore[assignment]
    w = MemoryWidget(profile, optimizer="sgd", gpu="A100 80GB")
    spy.widget = w
    history: list[str] = []
    w._status.observe(lambda c: history.append(c["new"]), names="value")
    assert not profile.is_cached("amp-bf16")
    assert _usable(w)

    w.precision = "amp-bf16"

    assert profile.is_cached("amp-bf16")
    assert w.estimate.precision.value == "amp-bf16"
    assert w.estimate.peak_bytes == profile.estimate(32, "amp-bf16", "sgd").peak_bytes
    # Every profiling run happened with the label up and every control disabled.
    assert spy.seen, "the new precision ran no profiling"
    for _run, status, busy in spy.seen:
        assert "profiling amp-bf16 / train / sgd" in status
        assert busy
    assert history[0] == spy.seen[0][1]  # shown before the work started
    # Afterwards: controls back, elapsed time shown.
    assert _usable(w)
    assert "profiled amp-bf16 / train / sgd in " in w._status.value
    # Once: the next moves at that precision run nothing, and the label goes.
    n = len(spy.seen)
    w.batch_size = 5
    w.precision = "fp32"
    w.precision = "amp-bf16"
    assert len(spy.seen) == n
    assert w._status.value == ""
    # Inference at a new precision profiles that pass (no optimizer in the label).
    w.mode = "inference"
    w.precision = "bf16"
    assert any("profiling bf16 / inference (" in s for _r, s, _b in spy.seen[n:]), spy.seen[n:]
    assert _usable(w)


def test_failed_profiling_keeps_last_setting() -> None:
    profile = profile_model(zoo.mlp(hidden=(64,)), input_size=(784,), device="cpu")
    spy = _Spy(profile._source, fail_on="fp16")
    profile._source = spy  # type: ignore[assignment]
    w = MemoryWidget(profile, batch_size=16)
    spy.widget = w
    before = w.estimate
    w.precision = "fp16"
    # The trait goes back, the view still shows fp32, the message says why; controls usable.
    assert w.precision == "fp32"
    assert w.estimate.precision.value == "fp32"
    assert w.estimate.peak_bytes == before.peak_bytes
    assert "could not profile fp16" in w._status.value
    assert "no kernel for fp16" in w._status.value
    assert _usable(w)
    w.batch_size = 17
    assert w.estimate.batch_size == 17 and w._status.value == ""


def test_custom_box_enabled_only_for_custom_gpu(profile: ModelProfile) -> None:
    w = MemoryWidget(profile)
    assert w._custom_box.disabled
    w.gpu = "custom"
    assert not w._custom_box.disabled
    w.gpu = "T4 16GB"
    assert w._custom_box.disabled


def test_bad_input_raises_what_profile_model_raises() -> None:
    from vram_widget import ProfilingError

    with pytest.raises(ValueError, match=r"input_size must be the shape of one sample"):
        show_memory(zoo.mlp(), input_size=(0,))
    with pytest.raises(ValueError, match=r"give the example input: input_size="):
        show_memory(zoo.mlp())
    # a control's own check of a starting value: a ValueError naming the setting
    with pytest.raises(ValueError, match=r"invalid setting: .*'batch_size'.* less than 1"):
        show_memory(zoo.mlp(), input_size=(784,), device="cpu", batch_size=0)

    class Broken(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("boom")

    with pytest.raises(ProfilingError, match="boom"):
        show_memory(Broken(), input_size=(4,), device="cpu")
    # settings that need no profile are refused before the model is run: not "boom"
    with pytest.raises(TypeError, match=r"unknown setting 'batch'; valid settings are batch_size"):
        show_memory(Broken(), input_size=(4,), device="cpu", batch=8)
    with pytest.raises(ValueError, match=r"GPU 'A100' is ambiguous"):
        show_memory(Broken(), input_size=(4,), device="cpu", gpu="A100")


def test_static_fallback_and_table(profile: ModelProfile) -> None:
    w = MemoryWidget(profile)
    bundle = w._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert "cdn.plot.ly" in bundle["text/html"]
    assert "Peak" in bundle["text/html"]
    df = w.to_dataframe()
    assert len(df) == len(profile.rows.names)
    assert df["activation_bytes"].sum() == w.estimate.activation_bytes
    csv = w.to_csv()
    assert csv is not None and csv.startswith("name,type")
    assert "<table>" in w._table.value


def test_thousand_modules() -> None:
    model = nn.Sequential(nn.Linear(8, 8), *[nn.Identity() for _ in range(999)])
    w = show_memory(model, input_size=(8,), device="cpu", depth=1)
    assert isinstance(w, MemoryWidget)
    w.depth = 0
    x = np.asarray(w.figure.data[1].x)
    assert len(x) <= 10  # forward runs grouped under the root
    w.batch_size = 1000
    assert w.figure.data[PEAK].y[0] == w.estimate.peak_bytes


def test_update_path_formats_only_shown_shapes(
    profile: ModelProfile, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``LayerTable.output_shape`` builds every row's tuple on each access (a 1,000-module
    model: ~6 ms per access, once per hovered group and table row took a move to 120 ms);
    the update path formats only the rows it shows."""
    from vram_widget._estimating.estimator import LayerTable

    w = MemoryWidget(profile, depth=2)

    def refuse(self: LayerTable) -> object:
        raise AssertionError("the update path built every row's output shape")

    monkeypatch.setattr(LayerTable, "output_shape", property(refuse))
    moves = [("batch_size", 7), ("depth", 0), ("mode", "inference"), ("depth", 1)]
    for name, value in [*moves, ("mode", "train")]:
        setattr(w, name, value)
    shape = "(7, 512)"  # zoo.mlp(): 784 -> 512 -> 512 -> 10
    assert f"<td>{shape}</td>" in w._table.value
    forward = w.figure.data[TRACE_NAMES.index("forward")]
    assert any(f"output shape: {shape}" in str(t) for t in forward.hovertext)


def test_download_csv_link(profile: ModelProfile) -> None:
    w = MemoryWidget(profile, batch_size=48)
    assert w._csv_link.value == ""  # built on demand, not on every move
    w._csv_button.click()
    link = w._csv_link.value
    m = re.search(r"download='([^']+)' href='data:text/csv;base64,([^']+)'", link)
    assert m is not None, link
    assert m.group(1) == w.csv_filename == "Sequential_layers.csv"
    csv = base64.b64decode(m.group(2)).decode("utf-8")
    assert csv == w.to_csv()
    df = pd.read_csv(io.StringIO(csv))
    est = profile.estimate(48)
    assert len(df) == len(est.layers.name)
    assert df["activation_bytes"].sum() == est.activation_bytes
    assert df["flops_forward"].sum() == est.flops_forward
    # A move makes the link stale: it goes, and the next click has the new numbers.
    w.batch_size = 96
    assert w._csv_link.value == ""
    w._csv_button.click()
    m = re.search(r"base64,([^']+)'", w._csv_link.value)
    assert m is not None
    df = pd.read_csv(io.StringIO(base64.b64decode(m.group(1)).decode("utf-8")))
    assert df["activation_bytes"].sum() == profile.estimate(96).activation_bytes


def test_table_rows_are_the_estimates(profile: ModelProfile) -> None:
    w = MemoryWidget(profile, batch_size=24, depth=1)
    rows = re.findall(r"<tr>(.*?)</tr>", w._table.value)
    cells = [re.findall(r"<td>(.*?)</td>", r) for r in rows[1:]]
    by_name = {c[0]: c for c in cells}
    layers = w.estimate.layers
    i = layers.name.index("0")  # the first Linear: 784 -> 512
    row = by_name["0"]
    assert row[1] == "Linear" and row[2] == "(24, 512)"
    assert row[3] == f"{24 * 512:,}" == f"{int(layers.output_numel[i]):,}"  # activations
    assert row[4] == f"{784 * 512 + 512:,}" == f"{int(layers.param_count[i]):,}"
    assert row[8] == f"{int(layers.activation_bytes[i]):,}"
    assert row[9] == f"{int(layers.flops_forward[i]):,}" == f"{2 * 24 * 784 * 512:,}"


def test_nothing_fits_names_the_largest_batch(profile: ModelProfile) -> None:
    w = MemoryWidget(profile, gpu="custom", custom_gib=0.125, batch_size=2**20)
    largest = profile.max_batch_size(GIB // 8, "fp32", "adam", "train")
    assert w.estimate.total_bytes > GIB // 8
    assert "does not fit" in w.headline_html
    assert f"largest batch <b>{largest:,}</b>" in w.headline_html
    w.custom_gib = 0.002  # 2 MiB: less than the parameters
    assert "does not fit" in w.headline_html
    assert "not even batch size 1 fits" in w.headline_html
    assert "largest batch <b>" not in w.headline_html


def test_extras_follow_the_chosen_gpu() -> None:
    # The cuBLAS workspaces in the reserve are the chosen GPU's: 32 MiB on an H100 (9.0),
    # 8,519,680 B on an A100 (8.0) or a T4 (7.5), two in a training step (the forward
    # thread's and autograd's); same capacity, so the A100 fits more.
    profile = profile_model(zoo.mlp(), input_size=(784,), device="cuda")
    w = MemoryWidget(profile, gpu="H100 SXM 80GB")
    assert w.estimate.extras.cublas_workspace_bytes == 2 * 33_554_432
    h100_largest = w.largest_batch()
    w.gpu = "A100 80GB"
    assert w.estimate.extras.cublas_workspace_bytes == 2 * 8_519_680
    assert w.estimate.peak_bytes == profile.estimate(w.batch_size).peak_bytes
    assert w.largest_batch() == profile.max_batch_size(80 * GIB, compute_capability=(8, 0))
    assert w.largest_batch() > h100_largest
    w.gpu = "T4 16GB"
    assert w.estimate.extras.cublas_workspace_bytes == 2 * 8_519_680


# --------------------------------------------------------------------------------------------
# The sequence length
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def token_profile() -> ModelProfile:
    entry = zoo.ZOO["dict_input"]  # input_ids / attention_mask (B, 32): a sequence axis
    return profile_model(entry.build(), inputs=entry.make_inputs(2))


def test_sequence_slider_drives_the_estimate(token_profile: ModelProfile) -> None:
    w = MemoryWidget(token_profile, batch_size=8)
    assert w.seq_len == 32 and w._seq_row.layout.display is None  # shown
    assert "Tokens per step</th><td>8 x 32 = 256" in w.summary_html
    w.seq_len = 200  # the first other length fits the profile in the length: "profiling"
    assert "profiled" in w._status.value and "200 tokens" in w._status.value
    expected = token_profile.estimate(8, seq_len=200)
    assert w.estimate.seq_len == 200 and w.estimate.peak_bytes == expected.peak_bytes
    assert "Tokens per step</th><td>8 x 200 = 1,600" in w.summary_html
    assert w._seq_slider.value == 200.0 and w._seq_box.value == 200
    w.seq_len = 1000  # numpy from here: no profiling status
    assert w._status.value == ""
    assert w.estimate.peak_bytes == token_profile.estimate(8, seq_len=1000).peak_bytes
    assert w.largest_batch() == token_profile.max_batch_size(
        w.target.memory_bytes, seq_len=1000, compute_capability=w.target.compute_capability
    )
    w._seq_box.value = 64  # the box is a control too
    assert w.seq_len == 64 and w.estimate.seq_len == 64


@pytest.mark.parametrize("value", [0, -1])
def test_bad_sequence_lengths_are_refused(token_profile: ModelProfile, value: int) -> None:
    w = MemoryWidget(token_profile)
    with pytest.raises(traitlets.TraitError, match="seq_len"):
        w.seq_len = value
    assert w.seq_len == 32


def test_no_sequence_slider_without_a_sequence(profile: ModelProfile) -> None:
    w = MemoryWidget(profile)
    assert w.seq_len is None and w._seq_row.layout.display == "none"
    assert "Tokens per step" not in w.summary_html
    with pytest.raises(traitlets.TraitError, match="no sequence axis"):
        w.seq_len = 16


def test_frontier_panel_draws_the_profile_frontier(token_profile: ModelProfile) -> None:
    w = MemoryWidget(token_profile, batch_size=8, gpu="A100 80GB")
    assert w._frontier_panel in w.children and w._frontier_panel.selected_index is None
    assert len(w._frontier_figure.data[0].x) == 0  # nothing computed while closed
    w._frontier_panel.selected_index = 0  # opening the panel is the trait
    assert w.show_frontier
    expected = token_profile.frontier(80 * GIB, compute_capability=w.target.compute_capability)
    line, here, largest = w._frontier_figure.data
    fits = expected.max_batch_sizes > 0
    assert list(line.x) == expected.seq_lens[fits].tolist()
    assert list(line.y) == expected.max_batch_sizes[fits].tolist()
    assert (here.x, here.y) == ((32,), (8,)) and here.marker.color == "#2CA02C"  # fits
    assert largest.y == (w.largest_batch(),)
    assert "A100 80GB" in w._frontier_figure.layout.title.text
    # the length and the batch move the markers only; the line is the same object's data
    w.seq_len = 1000
    assert here.x == (1000,) and largest.x == (1000,)
    assert largest.y == (
        token_profile.max_batch_size(80 * GIB, seq_len=1000, compute_capability=(8, 0)),
    )
    w.batch_size = largest.y[0] + 1
    assert here.marker.color == "#D62728"  # one sample past the frontier
    assert list(line.y) == expected.max_batch_sizes[fits].tolist()
    # the GPU and the precision redraw the line (a search with allocator replays at each
    # length, behind the same label as a profiling run)
    w.gpu = "T4 16GB"
    assert "computed the frontier for" in w._status.value
    assert max(line.y) < expected.max_batch_sizes.max()
    assert "T4 16GB" in w._frontier_figure.layout.title.text
    w.show_frontier = False
    assert w._frontier_panel.selected_index is None


def test_no_frontier_panel_without_a_sequence(profile: ModelProfile) -> None:
    w = MemoryWidget(profile, show_frontier=True)
    assert w._frontier_panel not in w.children
    assert len(w._frontier_figure.data[0].x) == 0


def test_levers_group_drives_the_estimate(token_profile: ModelProfile) -> None:
    # The zoo dict_input model has no repeated blocks: its checkpointing choices are "off"
    # and the classes with repeated instances; trainable patterns and micro-batches apply.
    w = MemoryWidget(token_profile, batch_size=8)
    assert w._levers_row in w._tabs.children[2].children
    assert "<th>Levers</th>" not in w.summary_html
    w.trainable = "head.*"
    expected = token_profile.estimate(8, trainable=["head.*"])
    assert w.estimate.peak_bytes == expected.peak_bytes
    assert w.estimate.levers.trainable == expected.levers.trainable
    w.grad_accumulation = 4
    expected = token_profile.estimate(8, trainable=["head.*"], grad_accumulation=4)
    assert w.estimate.peak_bytes == expected.peak_bytes and w.estimate.flops == expected.flops
    base = token_profile.estimate(8)
    saved = base.peak_bytes - expected.peak_bytes
    assert f"saves {format_bytes(saved)} at the peak" in w.summary_html
    assert "effective batch 4 x 8 = 32" in w.summary_html
    assert w.largest_batch() == token_profile.max_batch_size(
        w.target.memory_bytes,
        compute_capability=w.target.compute_capability,
        trainable=["head.*"],
        grad_accumulation=4,
    )
    with pytest.raises(traitlets.TraitError, match="matches no parameter"):
        w.trainable = "nothing.*"
    with pytest.raises(traitlets.TraitError, match=r"grad_accumulation|minimum"):
        w.grad_accumulation = 0
    assert w.trainable == "head.*" and w.grad_accumulation == 4


def test_checkpoint_choice_follows_the_model() -> None:
    model = zoo.causal_decoder(vocab_size=64, d_model=32, n_head=2, n_layer=2, max_len=64)
    profile = profile_model(model, inputs=torch.zeros(2, 16, dtype=torch.long))
    w = MemoryWidget(profile, batch_size=4, checkpoint="auto")
    dropdown = w._checkpoint_dropdown
    assert list(dropdown.options)[:2] == ["off", "auto"] and "DecoderBlock" in dropdown.options
    assert w.estimate.levers.checkpoint == profile.checkpoint_blocks == ("blocks.0", "blocks.1")
    assert w.estimate.peak_bytes == profile.estimate(4, checkpoint="auto").peak_bytes
    dropdown.value = "off"
    assert w.checkpoint == "off" and not w.estimate.levers.active
    with pytest.raises(traitlets.TraitError, match="no module of that class"):
        w.checkpoint = "Bottleneck"


def test_lora_rank_control() -> None:
    pytest.importorskip("peft")
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    profile = profile_model(model, input_size=(16,))
    w = MemoryWidget(profile, batch_size=4, optimizer="adamw")
    w.lora_rank = 2  # PEFT has no default targets for a plain Sequential: said, and kept
    assert "could not profile" in w._status.value and "target_modules" in w._status.value
    assert w.lora_rank == 0 and not w.estimate.levers.active
    w.trainable = "2.*"
    with pytest.raises(traitlets.TraitError, match="trainable or lora_rank, not both"):
        w.lora_rank = 2
    w.trainable = ""
    assert w.estimate.peak_bytes == profile.estimate(4, optimizer="adamw").peak_bytes


def test_reserved_line_and_expandable_toggle() -> None:
    # device="cuda": the summary gives the replayed allocator's reserved peak, the whole
    # blocks in use, and the other expandable_segments setting; the toggle swaps them.
    profile = profile_model(zoo.resnet18(), input_size=(3, 64, 64))
    w = MemoryWidget(profile, batch_size=16)
    plain = profile.estimate(16).allocator
    grown = profile.estimate(16).replayed(expandable_segments=True)
    assert plain is not None and grown is not None

    def reserved_line() -> str:
        return next(row for row in w.summary_html.split("<tr>") if "<th>Reserved</th>" in row)

    assert f"{format_bytes(plain.peak_reserved_bytes)} at the caching allocator's peak" in (
        reserved_line()
    )
    assert f"expandable_segments:True: {format_bytes(grown.peak_reserved_bytes)}" in (
        reserved_line()
    )
    w.expandable_segments = True
    assert f"{format_bytes(grown.peak_reserved_bytes)} at the caching allocator's peak" in (
        reserved_line()
    )
    assert "expandable_segments:False" in reserved_line()
    # the CPU has no caching allocator: no line, no toggle
    cpu = MemoryWidget(profile_model(zoo.mlp(hidden=(8,)), input_size=(784,), device="cpu"))
    assert "<th>Reserved</th>" not in cpu.summary_html


def test_capacity_below_the_cuda_context_is_said() -> None:
    profile = profile_model(zoo.mlp(hidden=(8,)), input_size=(784,))  # device="cuda"
    w = MemoryWidget(profile, gpu="64 MiB")
    assert "does not fit" in w.headline_html
    assert "the capacity is below the CUDA context alone" in w.headline_html
    assert w.largest_batch() == 0  # the API refuses such a capacity; the widget says why
    entry = zoo.ZOO["dict_input"]  # a sequence axis: the frontier panel, nothing fits
    tokens = profile_model(entry.build(), inputs=entry.make_inputs(2))
    shown = MemoryWidget(tokens, gpu="64 MiB", show_frontier=True)
    assert shown.frontier().max_batch_sizes.tolist() == [0]
    assert "below the CUDA context" in shown.summary_html


def test_device_line_gives_the_third_number() -> None:
    # allocated -> reserved -> device: est.device_bytes, with the context, in its own line
    profile = profile_model(zoo.resnet18(), input_size=(3, 64, 64))
    w = MemoryWidget(profile, batch_size=16)
    est = profile.estimate(16)
    assert est.device_bytes is not None and est.reserved_bytes is not None
    context = est.extras.cuda_context_bytes
    assert f"<b>{format_bytes(est.device_bytes)}</b>" in w.device_html  # no event loop: now
    assert f"({format_bytes(est.device_bytes - context)}), + the CUDA context" in w.device_html
    assert f"reserved {format_bytes(est.reserved_bytes)}" in w.device_html
    assert MemoryWidget(profile_model(zoo.mlp(), input_size=(784,), device="cpu")).device_html == ""


def _counted_device_searches(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[ModelProfile, MemoryWidget, list[int]]:
    """A ResNet-18 widget at batch 16 whose device-line searches are counted (the batch of
    each search, in order)."""
    from vram_widget._display import widget_summary

    profile = profile_model(zoo.resnet18(), input_size=(3, 64, 64))
    w = MemoryWidget(profile, batch_size=16)
    searched: list[int] = []
    device_text = widget_summary.device_text

    def counted(est: MemoryEstimate, gpu_name: str, capacity_bytes: int) -> str:
        searched.append(est.batch_size)
        return device_text(est, gpu_name, capacity_bytes)

    monkeypatch.setattr(widget_summary, "device_text", counted)
    return profile, w, searched


def test_device_line_waits_for_the_controls_to_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    # In a kernel (a running event loop) the allocator search runs once the moves stop:
    # two quick moves give one search, for the setting the controls rest on; until then the
    # headline shows "…" for the device figure and the verdict, then the exact numbers.
    profile, w, searched = _counted_device_searches(monkeypatch)

    async def move() -> tuple[str, Any, str, Any]:
        w.batch_size = 8
        w.batch_size = 32
        pending, pending_numbers = w.headline_html, w.headline
        await asyncio.sleep(3 * AT_REST_DELAY_S)
        return pending, pending_numbers, w.device_html, w.headline

    pending, before, rested, after = asyncio.run(move())
    assert before.fit_bytes is None and before.fits is None and "…" in pending
    assert w._details_panel.get_title(0) == "Details"  # "(updating…)" until then
    assert searched == [32]
    est = profile.estimate(32)
    device = est.device_bytes
    assert device is not None and f"<b>{format_bytes(device)}</b>" in rested
    assert after.fit_bytes == device and after.fits == est.fits(w.target.memory_bytes)
    assert f"<b>{format_bytes(device)}</b> device" in w.headline_html


def test_reading_the_summary_fills_a_pending_rest_now(monkeypatch: pytest.MonkeyPatch) -> None:
    # A cell that moves a control and reads the words in the same kernel turn (the
    # quickstart's "HTML(w.summary_html)" under Run All) gets the new setting's numbers: the
    # pending rest is filled on the read, once, and its timer cancelled (no second search).
    profile, w, searched = _counted_device_searches(monkeypatch)

    async def move() -> tuple[str, str]:
        w.batch_size = 32
        pending = w.headline_html
        summary = w.summary_html  # fills the rest now
        await asyncio.sleep(3 * AT_REST_DELAY_S)  # the cancelled timer does not run
        return pending, summary

    pending, summary = asyncio.run(move())
    assert "…" in pending and "…" not in summary
    assert searched == [32]
    # the details are batch 32's (16 before the move)
    assert "train, batch 32 (inputs:" in summary
    device = profile.estimate(32).device_bytes
    assert device is not None and f"<b>{format_bytes(device)}</b> device" in summary
    assert w._details_panel.get_title(0) == "Details"


def test_tensor_parallel_control() -> None:
    # tp is a trait like the rest, in the GPUs group; a new tp question profiles one rank
    # behind the label, with every control disabled, and is answered from memory after
    pytest.importorskip("transformers")
    from models import hf_llama, hf_tokens

    torch.manual_seed(0)
    profile = profile_model(hf_llama(), inputs=hf_tokens(2), device="cpu")
    spy = _Spy(profile._source)
    profile._source = spy  # type: ignore[assignment]
    w = MemoryWidget(profile, batch_size=2, mode="inference")
    spy.widget = w
    dropdown = w._tp_dropdown
    assert dropdown in w.control_groups["GPUs"] and not dropdown.disabled
    assert list(dropdown.options) == [1]  # the degrees up to the GPUs (1)
    w.gpus = 4
    assert list(dropdown.options) == [1, 2, 4]
    w.gpus = 2
    assert list(dropdown.options) == [1, 2]
    assert not profile.tensor_parallel_cached(2, mode="inference", gpus=2, tp=2)
    dropdown.value = 2  # the control writes the trait
    assert w.tp == 2 and w.estimate.tp == 2
    assert [run for run, _s, _b in spy.seen] == ["tp=2"]
    assert "profiling fp32 / inference" in spy.seen[0][1] and "tp=2" in spy.seen[0][1]
    assert spy.seen[0][2]  # every control disabled while it ran
    assert _usable(w) and "profiled fp32 / inference" in w._status.value
    # the batch is in the sub-profile's key: a new batch profiles, behind the label too
    w.batch_size = 3
    assert len(spy.seen) == 2 and spy.seen[1][2] and w.estimate.tp == 2
    w.batch_size = 2  # asked before: from memory
    assert len(spy.seen) == 2
    assert w._status.value == "" or "profil" not in w._status.value
    # the searches over the batch are not run with tp > 1 (each batch is a profile)
    assert "largest batch not searched with tp &gt; 1" in w.summary_html
    assert len(spy.seen) == 2
    spy.widget = None  # the same question asked directly (the card's settings aside)
    asked = profile.estimate(2, mode="inference", gpus=2, tp=2, compute_capability=(9, 0))
    assert w.estimate.peak_bytes == asked.peak_bytes
    w.tp = 1
    assert w.estimate.tp == 1 and w._tp_dropdown.value == 1


def test_tensor_parallel_control_without_a_plan() -> None:
    # a model with no tensor-parallel plan: the control is off, its tooltip says why
    profile = profile_model(zoo.mlp(hidden=(16,)), input_size=(784,), device="cpu")
    w = MemoryWidget(profile, gpus=2)
    assert w._tp_dropdown.disabled
    assert "has no tensor-parallel plan" in w._tp_dropdown.tooltip
    assert _usable_with_tp_off(w)


def _usable_with_tp_off(w: MemoryWidget) -> bool:
    """Every control but the tp dropdown usable after a move (which re-enables them)."""
    w.batch_size = 5
    return w._tp_dropdown.disabled and not w._batch_slider.disabled


def test_data_parallel_group() -> None:
    # GPUs and strategy are traits like the rest: the estimate is one rank's, the summary
    # gives the global batch, and the "GPUs needed" line is ModelProfile.min_gpus.
    profile = profile_model(zoo.mlp(), input_size=(784,))
    w = MemoryWidget(profile, batch_size=16, optimizer="adamw")
    assert w.estimate.gpus == 1 and "Data parallel" not in w.summary_html
    assert w.parallel_html == "1 x H100 SXM 80GB with ddp at batch 16 per GPU (global batch 16)"
    assert f"<th>GPUs needed</th><td>{w.parallel_html}</td>" in w.details_html
    w.gpus = 4
    est = profile.estimate(16, optimizer="adamw", gpus=4)
    assert w.estimate.peak_bytes == est.peak_bytes and w.estimate.communication_bytes > 0
    assert "global batch 4 x 16 = 64" in w.summary_html
    w.strategy = "zero1"
    zero = profile.estimate(16, optimizer="adamw", gpus=4, strategy="zero1")
    assert w.estimate.peak_bytes == zero.peak_bytes < est.peak_bytes
    assert f"rank {zero.rank}" in w.summary_html
    # a card the single step does not fit: DDP never helps, ZeRO-1's sharded state may
    context = profile.estimate(1).extras.cuda_context_bytes
    single = profile.estimate(16, optimizer="adamw").device_bytes
    assert single is not None
    w.gpu, w.custom_gib = "custom", (single - 2**21) / 2**30
    # 2 ranks halve the AdamW state: 2 MiB less on the device, just what the card lacks
    assert profile.min_gpus(w.target.memory_bytes, 16, optimizer="adamw", strategy="zero1") == 2
    two = profile.estimate(16, optimizer="adamw", gpus=2, strategy="zero1").device_bytes
    assert two is not None and two <= w.target.memory_bytes < single
    assert w.parallel_html.startswith("2 x custom")
    assert "(global batch 32)" in w.parallel_html
    w.strategy = "ddp"
    assert (
        "no number up to 1,024 fits" in w.parallel_html and "DDP keeps the whole" in w.parallel_html
    )
    assert context < w.target.memory_bytes
    w.mode = "inference"
    assert w.parallel_html == "" and w.estimate.gpus == 1  # inference is not wrapped
    with pytest.raises(traitlets.TraitError):
        w.gpus = 0
    with pytest.raises(traitlets.TraitError):
        w.strategy = "zero4"  # not a strategy


def test_fsdp_strategies_in_the_widget() -> None:
    # zero3 / hsdp from the strategy control: one rank's FSDP2 step, NCCL's buffers named
    # beside the totals; an hsdp world that is not whole nodes keeps the last setting
    entry = zoo.ZOO["llama_tiny"]
    profile = profile_model(entry.build(), inputs=entry.make_inputs(2))
    w = MemoryWidget(profile, batch_size=4, optimizer="adamw")
    w.gpus, w.strategy = 8, "zero3"
    est = profile.estimate(4, optimizer="adamw", gpus=8, strategy="zero3")
    assert w.estimate.peak_bytes == est.peak_bytes
    assert w.estimate.parameter_bytes == est.parameter_bytes < profile.estimate(4).parameter_bytes
    assert "NCCL's own buffers" in w.summary_html and "outside the allocator" in w.summary_html
    # amp-bf16 under FSDP2 steps on bf16 parameters (MixedPrecisionPolicy): a profiling
    # run of its own, so the widget says it is profiling, as for a new precision
    assert not profile.is_cached("amp-bf16", "train", "adamw", None, NO_LEVERS,
                                 resolve_parallel(8, "zero3"))  # fmt: skip
    w.precision = "amp-bf16"
    assert w._status.value.startswith("<i>profiled amp-bf16")
    w.precision = "fp32"
    w.strategy = "hsdp"
    assert w.estimate.strategy == "hsdp" and w.estimate.nccl is not None
    assert w.estimate.nccl.communicators == 2
    w.gpus = 12  # 8 GPUs per node: not whole nodes
    assert w.gpus == 8 and "not a whole number of nodes" in w._status.value
    assert "could not estimate" in w._status.value  # a setting refused, nothing profiled
    # the per-node box shows with hsdp only; 12 GPUs in nodes of 4 is 3 whole nodes, each
    # rank's estimate the profile's for that mesh (shards of 4, not of 8)
    assert w._per_node_box.layout.display is None
    w.gpus_per_node = 4
    w.gpus = 12
    est = profile.estimate(4, optimizer="adamw", gpus=12, strategy="hsdp", gpus_per_node=4)
    assert w.gpus == 12 and w.estimate.peak_bytes == est.peak_bytes
    assert (
        est.parameter_bytes
        > profile.estimate(
            4, optimizer="adamw", gpus=12, strategy="hsdp", gpus_per_node=12
        ).parameter_bytes
    )
    w._per_node_box.value = 6  # the box drives the trait: 2 nodes of 6
    assert (
        w.gpus_per_node == 6
        and w.estimate.peak_bytes
        == profile.estimate(
            4, optimizer="adamw", gpus=12, strategy="hsdp", gpus_per_node=6
        ).peak_bytes
    )
    w.strategy = "zero3"
    assert w._per_node_box.layout.display == "none"


# -- generation --------------------------------------------------------------------------


def _gpt2_widget(**settings: object) -> tuple[MemoryWidget, ModelProfile]:
    pytest.importorskip("transformers")
    from tests.models import hf_gpt2

    torch.manual_seed(0)
    ids = torch.zeros(2, 16, dtype=torch.long)
    profile = profile_model(hf_gpt2(), inputs={"input_ids": ids}, device="cpu")
    return MemoryWidget(profile, **settings), profile


def test_generation_group_drives_the_estimate() -> None:
    # mode "generate" shows the generation row (new tokens) and relabels the sequence slider
    # as the prompt; every number shown is the profile's estimate at the traits
    w, profile = _gpt2_widget(batch_size=4)
    assert w.new_tokens == 48  # 128 by default, less where GPT-2's 64 positions end first
    assert w._generation_row.layout.display == "none"
    assert "generate" in w._mode_buttons.options
    w.mode = "generate"
    w.new_tokens = 40
    w.seq_len = 8
    assert w._generation_row.layout.display is None
    assert w._seq_slider.description == "prompt length"
    assert (w._tokens_box.value, w._seq_box.value) == (40, 8)
    expected = profile.estimate(4, mode="generate", seq_len=8, new_tokens=40)
    assert w.estimate.peak_bytes == expected.peak_bytes == w.figure.data[PEAK].y[0]
    # the summary: the cache and the most sequences at once on the chosen card
    most = profile.max_batch_size(w.target.memory_bytes, mode="generate", seq_len=8, new_tokens=40)
    assert w.largest_batch() == most
    summary = w.summary_html
    assert f"KV cache</b> {format_bytes(expected.kv_cache_bytes)}" in summary
    assert "1.00 KiB per token per sequence" in summary  # 2 layers x k, v x 64 x 4 B
    assert f"most sequences at once <b>{most:,}</b>" in w.headline_html
    assert f"decode step {expected.peak_step:,} of 39" in summary
    w.mode = "train"
    assert w._generation_row.layout.display == "none"
    assert w._seq_slider.description == "sequence length"
    assert w.estimate.kv_cache_bytes is None


def test_generation_past_the_positions_keeps_the_last_setting() -> None:
    w, _profile = _gpt2_widget(mode="generate", new_tokens=30)
    w.new_tokens = 60  # 16 + 60 > 64 positions
    assert w.new_tokens == 30
    assert "beyond the model&#x27;s limit of 64" in w._status.value


def test_generate_is_offered_only_to_a_model_that_generates() -> None:
    profile = profile_model(zoo.mlp(hidden=(8,)), input_size=(784,), device="cpu")
    w = MemoryWidget(profile)
    assert "generate" not in w._mode_buttons.options
    with pytest.raises(traitlets.TraitError, match="needs a model that generates"):
        w.mode = "generate"


def test_no_torch_when_new_tokens_move(monkeypatch: pytest.MonkeyPatch) -> None:
    # after the generation's profile, any number of new tokens and any batch are numpy
    w, profile = _gpt2_widget(mode="generate", new_tokens=8)

    class Refuse:
        def __getattr__(self, name: str) -> object:
            raise AssertionError(f"the update path asked the profiler for {name}")

    monkeypatch.setattr(profile, "_source", Refuse())
    caches = []
    moves = [("new_tokens", 40), ("new_tokens", 2), ("batch_size", 64), ("new_tokens", 47)]
    for name, value in moves:
        setattr(w, name, value)
        caches.append(w.estimate.kv_cache_bytes)
    assert w._status.value == ""
    # the cache holds 16 + T - 1 tokens of 1,024 B per sequence: 32 x 55, 32 x 17, 64 x 17,
    # 64 x 62
    assert caches == [1024 * n for n in (32 * 55, 32 * 17, 64 * 17, 64 * 62)]


# --------------------------------------------------------------------------------------------
# One capacity parser: every entry point reads each form alike
# --------------------------------------------------------------------------------------------

_CAPACITY_FORMS = [
    (2**31, 2**31),
    (np.int64(2**31), 2**31),
    ("2G", 2**31),  # a bare G is binary: 2 * 2**30 = 2,147,483,648
    ("2 GiB", 2**31),
    ("2Gi", 2**31),
    ("2048M", 2**31),  # 2048 * 2**20
    ("2GB", 2_000_000_000),  # SI: 2 * 10**9
    ("2gb", 2_000_000_000),
    ("T4", 16 * GIB),  # a catalog name: T4 16GB
    ("A100 80GB", 80 * GIB),  # the vendor's 80GB read as GiB
    ("H100", 80 * GIB),  # H100 SXM 80GB, the first of the two 80 GiB H100s
]
_BAD_CAPACITIES = [80, 80.0, "80", "A100", np.float64(2**31), True]


class _Broken(nn.Module):
    """A model no profile can run: show_memory must refuse a bad capacity before trying."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")


def _entry_points(
    profile: ModelProfile, capability: tuple[int, int] | None, explicit: bool
) -> dict[str, Any]:
    """Each function that takes a capacity, for an estimate at ``capability`` (the
    searches are given it only where ``explicit``: a catalog name brings its own)."""
    est = profile.estimate(8, "fp32", "adam", compute_capability=capability)
    kw: dict[str, Any] = {"compute_capability": capability} if explicit and capability else {}
    return {
        "fits": est.fits,
        "fits_device": est.fits_device,
        "max_batch_size": lambda c: profile.max_batch_size(c, **kw),
        "max_seq_len": lambda c: profile.max_seq_len(c, batch_size=8, **kw),
        "frontier": lambda c: profile.frontier(c, seq_lens=[16, 32], **kw).max_batch_sizes.tolist(),
        "min_gpus": lambda c: profile.min_gpus(c, 8, **kw),
    }


@pytest.mark.parametrize(("form", "nbytes"), _CAPACITY_FORMS)
def test_every_entry_point_reads_a_capacity_form_alike(
    token_profile: ModelProfile, form: object, nbytes: int
) -> None:
    # Each function given the form answers as it does given the bytes worked out by hand
    # (and, for a catalog name, the GPU's compute capability, which a name brings along);
    # the widget's target is those bytes, and its largest batch is the API's.
    target = resolve_gpu(form)
    capability = target.compute_capability if target.name in GPUS else None
    given_form = _entry_points(token_profile, capability, explicit=False)
    given_bytes = _entry_points(token_profile, capability, explicit=True)
    for name, call in given_form.items():
        assert call(form) == given_bytes[name](nbytes), name
    w = MemoryWidget(token_profile, gpu=form, batch_size=8)
    assert w.target.memory_bytes == nbytes
    assert w.target.compute_capability == capability
    assert w.largest_batch() == token_profile.max_batch_size(nbytes, compute_capability=capability)
    assert w.estimate.fits(nbytes) is given_bytes["fits"](nbytes)


@pytest.mark.parametrize("form", _BAD_CAPACITIES)
def test_every_entry_point_refuses_a_bad_capacity_alike(
    token_profile: ModelProfile, form: object
) -> None:
    # the same ValueError, word for word, from the parser and from every entry point;
    # show_memory raises it before profiling (the model here cannot even be run)
    from vram_widget._estimating.gpus import parse_capacity

    with pytest.raises(ValueError) as parsed:
        parse_capacity(form)
    message = str(parsed.value)
    assert "'80GiB'" in message and "'A100 80GB'" in message
    calls = {
        **_entry_points(token_profile, None, explicit=False),
        "MemoryWidget(gpu=)": lambda c: MemoryWidget(token_profile, gpu=c),
        "show_memory(gpu=)": lambda c: show_memory(_Broken(), input_size=(4,), gpu=c),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError) as err:
            call(form)
        assert str(err.value) == message, name


# ---------------------------------------------------------------- the optimizer controls


def test_optimizer_controls_offer_every_optimizer_name(profile: ModelProfile) -> None:
    # two dropdowns for one name: the optimizer, and its implementation (disabled where
    # torch.optim runs the optimizer one way only); every name the estimate takes is one
    # pair, and each pair writes that name into the one trait
    from vram_widget._display.optimizer_control import join_choice, optimizer_groups
    from vram_widget._estimating.options import optimizer_names

    w = MemoryWidget(profile, batch_size=8)
    controls = w._optimizer_controls
    groups = optimizer_groups()
    pairs = [(base, impl) for base, impls in groups.items() for impl in (None, *impls)]
    assert sorted(join_choice(b, i) for b, i in pairs) == sorted(optimizer_names())
    assert controls.optimizer.options == (*groups, "none")
    assert groups["adamw"] == ("fused", "foreach", "forloop") and groups["adagrad"] == ()
    # the default names the implementation torch picks on the profile's device (CPU:
    # the for-loop, torch/optim/optimizer.py _default_to_fused_or_foreach)
    assert controls.implementation.options[0] == ("default (for-loop on cpu)", "default")
    controls.optimizer.value = "adamw"
    controls.implementation.value = "foreach"
    assert w.optimizer == "adamw-foreach" and not controls.implementation.disabled
    controls.optimizer.value = "adagrad"  # no implementations: back to torch's default
    assert w.optimizer == "adagrad"
    assert controls.implementation.value == "default" and controls.implementation.disabled
    controls.optimizer.value = "none"
    assert w.optimizer == "none" and w.estimate.optimizer is None
    w.optimizer = "sgd-momentum-fused"  # the trait drives the controls too
    assert (controls.optimizer.value, controls.implementation.value) == ("sgd-momentum", "fused")


def test_optimizer_control_lists_the_names_at_run_time(
    profile: ModelProfile, monkeypatch: pytest.MonkeyPatch
) -> None:
    # an optimizer added to optimizer_names() (another library's, with no implementations)
    # is offered, grouped on its own, with no change to the widget
    from vram_widget._display import optimizer_control, widget_settings
    from vram_widget._estimating.options import optimizer_names

    names = (*optimizer_names(), "lion8bit")
    monkeypatch.setattr(optimizer_control, "optimizer_names", lambda: names)
    monkeypatch.setattr(widget_settings, "optimizer_names", lambda: names)
    w = MemoryWidget(profile, batch_size=8)
    assert w._optimizer_controls.optimizer.options[-2:] == ("lion8bit", "none")
    assert w._optimizer_controls.groups["lion8bit"] == ()
    MemoryWidget.optimizer.validate(w, "lion8bit")  # the trait takes it


def test_implementation_control_drives_estimate_behind_a_progress_label() -> None:
    profile = profile_model(zoo.mlp(hidden=(64,)), input_size=(784,), device="cpu")
    spy = _Spy(profile._source)
    profile._source = spy  # type: ignore[assignment]
    w = MemoryWidget(profile, batch_size=8, optimizer="adamw", gpu="A100 80GB")
    spy.widget = w
    before = w.figure.data[PEAK].y[0]
    assert not profile.is_cached("fp32", "train", "adamw-foreach")
    assert "optimizer adamw (forloop: torch's default on cpu)" in w.summary_html

    w._optimizer_controls.implementation.value = "foreach"

    expected = profile.estimate(8, optimizer="adamw-foreach")
    assert w.optimizer == "adamw-foreach"
    assert w.estimate.peak_bytes == expected.peak_bytes
    assert w.estimate.optimizer_implementation == "foreach"
    # a foreach step's temporaries span the whole group, the loop's one parameter: the
    # peak moves, and the figure shows it
    assert w.figure.data[PEAK].y[0] == expected.peak_bytes != before
    assert "optimizer adamw (foreach)" in w.summary_html
    # the first use of that implementation profiled its step, behind the label
    assert spy.seen and all(busy for _r, _s, busy in spy.seen)
    assert all("profiling fp32 / train / adamw-foreach" in s for _r, s, _b in spy.seen)
    assert "profiled fp32 / train / adamw-foreach in " in w._status.value
    assert _usable(w)
    n = len(spy.seen)
    w.batch_size = 16  # cached since: numpy only, no label
    assert len(spy.seen) == n and w._status.value == ""


def test_stepping_toggles_drive_estimate_and_summary(profile: ModelProfile) -> None:
    w = MemoryWidget(profile, batch_size=8, optimizer="adamw")
    controls = w._optimizer_controls
    assert "post-accumulate-grad hook" in controls.in_backward.tooltip
    assert "set_to_none=False" in controls.keep_grads.tooltip
    plain = w.estimate.peak_bytes

    controls.in_backward.value = True

    expected = profile.estimate(8, optimizer="adamw", optimizer_in_backward=True)
    assert w.optimizer_in_backward is True
    assert w.estimate.peak_bytes == expected.peak_bytes != plain
    assert w.figure.data[PEAK].y[0] == expected.peak_bytes
    assert w.estimate.levers.in_backward == "adamw-forloop"
    assert "optimizer adamw (forloop: torch's default on cpu), stepped in the backward" in (
        w.summary_html
    )
    # the levers line compares with the same step taken after the backward
    assert f"({format_bytes(plain)} without)" in w.summary_html

    controls.in_backward.value = False
    controls.keep_grads.value = True

    expected = profile.estimate(8, optimizer="adamw", set_to_none=False)
    assert w.set_to_none is False
    assert w.estimate.peak_bytes == expected.peak_bytes
    assert w.figure.data[PEAK].y[0] == expected.peak_bytes
    assert "gradients kept between steps (zero_grad(set_to_none=False))" in w.summary_html
    assert "stepped in the backward" not in w.summary_html
    w.set_to_none = True  # the trait drives the checkbox
    assert controls.keep_grads.value is False and w.estimate.peak_bytes == plain


@pytest.mark.parametrize(
    ("first", "refused", "reason"),
    [
        # in backward first, then a setting it cannot go with: that setting is kept
        (("optimizer_in_backward", True), ("grad_accumulation", 2), "nothing to accumulate"),
        (("optimizer_in_backward", True), ("gpus", 2), "not estimated yet"),
        (("optimizer_in_backward", True), ("set_to_none", False), "no gradient is kept"),
        # and the other way round: the toggle is kept off
        (("grad_accumulation", 4), ("optimizer_in_backward", True), "nothing to accumulate"),
        (("set_to_none", False), ("optimizer_in_backward", True), "no gradient is kept"),
        (("optimizer", "none"), ("optimizer_in_backward", True), "needs an optimizer"),
    ],
)
def test_refused_stepping_combination_keeps_last_state(
    profile: ModelProfile,
    first: tuple[str, object],
    refused: tuple[str, object],
    reason: str,
) -> None:
    w = MemoryWidget(profile, batch_size=8, optimizer="adam")
    setattr(w, *first)
    before = w.estimate.peak_bytes
    figure = w.figure.data[PEAK].y[0]
    name, value = refused
    old = getattr(w, name)

    if name in ("optimizer_in_backward", "set_to_none"):  # through its checkbox
        box = w._optimizer_controls
        control = box.in_backward if name == "optimizer_in_backward" else box.keep_grads
        control.value = value if name == "optimizer_in_backward" else not value
    else:
        setattr(w, name, value)

    assert getattr(w, name) == old  # kept, and the checkbox shows the kept state
    assert w._optimizer_controls.in_backward.value is w.optimizer_in_backward
    assert w._optimizer_controls.keep_grads.value is (not w.set_to_none)
    assert w.estimate.peak_bytes == before and w.figure.data[PEAK].y[0] == figure
    status = html.unescape(w._status.value)
    assert "could not estimate" in status and reason in status
    assert f"kept {name} = {old!r}" in status
    assert _usable(w)


def test_show_memory_takes_optimizer_settings() -> None:
    w = show_memory(
        zoo.mlp(hidden=(32,)),
        input_size=(784,),
        device="cpu",
        batch_size=4,
        optimizer="adamw-fused",
        optimizer_in_backward=True,
    )
    expected = w.profile.estimate(4, optimizer="adamw-fused", optimizer_in_backward=True)
    assert (w.optimizer, w.optimizer_in_backward) == ("adamw-fused", True)
    assert w.estimate.peak_bytes == expected.peak_bytes
    assert w._optimizer_controls.implementation.value == "fused"
    assert w._optimizer_controls.in_backward.value is True
    assert "optimizer adamw (fused), stepped in the backward" in w.summary_html


@pytest.mark.parametrize(
    ("settings", "error", "match"),
    [
        ({"optimizer": "lion"}, ValueError, r"unknown optimizer 'lion'.*'adamw-fused'"),
        ({"optimizer": "adagrad-fused"}, ValueError, "unknown optimizer 'adagrad-fused'"),
        ({"optimizer_in_backward": "yes"}, TypeError, "in_backward must be True or False"),
        ({"optimizer_in_backward": True, "set_to_none": False}, ValueError, "cannot go with"),
        ({"optimizer_in_backward": True, "grad_accumulation": 2}, ValueError, "accumulate"),
        ({"optimizer_in_backward": True, "gpus": 4}, ValueError, "gpus=1"),
        ({"set_to_none": False, "gpus": 2, "strategy": "zero1"}, ValueError, "gpus=1"),
        ({"optimizer": None, "optimizer_in_backward": True}, ValueError, "needs an optimizer"),
    ],
)
def test_show_memory_refuses_optimizer_settings_before_profiling(
    settings: dict[str, Any], error: type[Exception], match: str
) -> None:
    # _Broken cannot be run: the error is the setting's, raised before any profiling
    with pytest.raises(error, match=match):
        show_memory(_Broken(), input_size=(4,), device="cpu", **settings)


def test_summary_names_the_cuda_context_figure_and_its_source() -> None:
    from vram_widget._estimating.accelerator import cuda_context

    w = show_memory(zoo.mlp(), input_size=(784,), gpu="A100 80GB")
    row = cuda_context((8, 0))  # an A100, lazy module loading (torch's default)
    assert w.estimate.extras.cuda_context_source == row.source
    summary = w.summary_html
    assert html.escape(row.source) in summary  # the whole source, on hover
    assert f"({row.source.partition(':')[0]})</span>" in summary  # its kind, in the line


def test_a_recipe_starts_the_controls_and_holds_what_has_no_control() -> None:
    import dataclasses

    from vram_widget import Recipe

    recipe = Recipe().with_(
        batch_size=8, precision="bf16", optimizer="adamw-fused", context_bytes=2**30
    )
    recipe = dataclasses.replace(recipe, ignored=("torch_compile=True: not estimated",))
    profile = profile_model(zoo.mlp(), input_size=(784,))
    w = show_memory(zoo.mlp(), input_size=(784,), recipe=recipe)
    # the controls start at the recipe's values, and the context (no control) is held
    assert (w.batch_size, w.precision, w.optimizer) == (8, "bf16", "adamw-fused")
    assert w.estimate.peak_bytes == profile.estimate(recipe=recipe).peak_bytes
    assert w.estimate.extras.cuda_context_bytes == 2**30
    w.batch_size = 16  # a move keeps the held setting
    assert w.estimate.extras.cuda_context_bytes == 2**30
    assert w.estimate.peak_bytes == profile.estimate(recipe=recipe.with_(batch_size=16)).peak_bytes
    assert "torch_compile=True: not estimated" in w.summary_html
    # a setting given twice must agree; a recipe setting the widget cannot hold is named
    with pytest.raises(ValueError, match="batch_size=4 conflicts with the recipe's 8"):
        show_memory(zoo.mlp(), input_size=(784,), recipe=recipe, batch_size=4)
    with pytest.raises(ValueError, match="rank=1 has no control"):
        show_memory(zoo.mlp(), input_size=(784,), recipe=Recipe().with_(gpus=2, rank=1))


# The layout: the answer first, controls grouped by question
# --------------------------------------------------------------------------------------------


def test_answer_first_then_bar_controls_figure_and_details(profile: ModelProfile) -> None:
    w = MemoryWidget(profile)
    assert w.children[:5] == (w._headline, w._status, w._bar, w._controls, w.figure)
    assert w._details_panel in w.children and w._details_panel.selected_index is None
    # as wide as the notebook, the plot resizing with it (no fixed width, a fixed height);
    # the boxes inside stretch across it with no width of their own (a "100%" plus each
    # widget's 2 px margin drew the tabs past the output's right edge in JupyterLab)
    assert w.layout.width == "100%"
    assert w._controls.layout.width is None and w._tabs.layout.width is None
    assert w._display_menu.layout.width is None
    # the mode buttons beside their label (ToggleButtons is a block: they went under it)
    assert w._mode_buttons.layout.display == "flex"
    assert w.figure.layout.autosize is True and w.figure.layout.width is None
    assert w.figure.layout.height is not None


def test_controls_grouped_by_question_with_labels_and_tooltips(profile: ModelProfile) -> None:
    w = MemoryWidget(profile)
    groups = w.control_groups
    assert list(groups) == ["Step", "Optimizer", "Memory levers", "GPUs", "Display"]
    assert [w._tabs.get_title(i) for i in range(4)] == list(groups)[:4]
    labels = {
        title: [c.description for c in controls if c.description]
        for title, controls in groups.items()
    }
    assert labels == {
        "Step": [
            "batch size",
            "sequence length",
            "precision",
            "weights",
            "mode",
            "compile",
            "memory budget",
            "new tokens",
            "KV cache",
        ],
        "Optimizer": ["optimizer", "implementation", "in backward", "keep grads"],
        "Memory levers": [
            "checkpointing",
            "checkpoint policy",
            "k",
            "trainable",
            "micro-batches",
            "LoRA rank",
            "loss chunks",
            "offload activations",
        ],
        "GPUs": [
            "GPU",
            "custom GiB",
            "expandable_segments",
            "GPUs",
            "strategy",
            "per node",
            "tp",
            "ep",
            "cp",
            "pp",
            "schedule",
            "stages a rank",
            "pp micro-batches",
        ],
        "Display": ["group depth"],
    }
    every = [c for controls in groups.values() for c in controls]
    assert sorted(map(id, every)) == sorted(map(id, w._control_widgets))  # each shown once
    for control in every:
        assert control.tooltip, control  # says what it changes
        if not control.description:  # the exact box beside a labelled slider
            assert isinstance(control, widgets.BoundedIntText)


def test_headline_numbers_are_the_estimates(profile: ModelProfile) -> None:
    # device="cpu": the number compared with the card is total_bytes ("allocated"), exactly
    # what estimate(), fits() and max_batch_size() give at the same setting
    w = MemoryWidget(profile, gpu="T4 16GB", batch_size=24, optimizer="sgd")
    est = profile.estimate(24, optimizer="sgd", compute_capability=w.target.compute_capability)
    capacity = GPUS["T4 16GB"].memory_bytes
    h = w.headline
    assert (h.fit_bytes, h.fit_label) == (est.total_bytes, "allocated")
    assert h.fits is est.fits(capacity) is True
    assert h.largest_batch == profile.max_batch_size(
        capacity, optimizer="sgd", compute_capability=w.target.compute_capability
    )
    assert (h.flops, h.batch_size, h.tokens_count) == (est.flops, 24, None)
    assert h.longest_seq is None and not h.has_seq_axis
    text = w.headline_html
    assert f"<b>{format_bytes(est.total_bytes)}</b> allocated" in text
    assert f"largest batch <b>{h.largest_batch:,}</b>" in text
    assert "24 samples per step" in text


def test_headline_on_cuda_gives_device_bytes_and_the_longest_sequence() -> None:
    entry = zoo.ZOO["dict_input"]  # a sequence axis; device="cuda"
    tokens = profile_model(entry.build(), inputs=entry.make_inputs(2))
    w = MemoryWidget(tokens, batch_size=8, gpu="T4 16GB")
    capacity = GPUS["T4 16GB"].memory_bytes
    cc = w.target.compute_capability
    # before the profile is fitted in the length, the headline says how to get it
    assert w.headline.longest_seq is None and "move the sequence length" in w.headline_html
    w.seq_len = 64  # the first other length: the fit in the length
    est = tokens.estimate(8, seq_len=64, compute_capability=cc)
    h = w.headline
    assert (h.fit_bytes, h.fit_label) == (est.device_bytes, "device")
    assert h.fits is est.fits(capacity)
    assert h.largest_batch == tokens.max_batch_size(capacity, seq_len=64, compute_capability=cc)
    assert h.longest_seq == tokens.max_seq_len(capacity, 8, compute_capability=cc)
    assert h.tokens_count == 8 * 64 and "512 tokens per step" in w.headline_html
    assert f"longest sequence <b>{h.longest_seq:,}</b> at batch 8" in w.headline_html


def test_bar_shows_what_fills_the_peak(profile: ModelProfile) -> None:
    w = MemoryWidget(profile, batch_size=8)
    parts = re.findall(r"title='([^:]+): ([\d,]+) B' style='width:([\d.]+)%", w._bar.value)
    breakdown = w.estimate.peak_breakdown
    assert [(name, int(n.replace(",", ""))) for name, n, _ in parts] == [
        (c.value, breakdown[c])
        for c in breakdown
        if breakdown[c]  # Category order
    ]
    # the parameters: (784 x 512 + 512) + (512 x 512 + 512) + (512 x 10 + 10) = 669,706
    # floats of 4 B = 2,678,824 B
    assert parts[0][:2] == ("Parameter", "2,678,824")
    assert sum(float(width) for *_, width in parts) == pytest.approx(100, abs=0.01)


def test_largest_batch_of_a_new_setting_lands_at_rest(profile: ModelProfile) -> None:
    w = MemoryWidget(profile, batch_size=8)

    async def move() -> tuple[Any, str, Any]:
        w.gpu = "T4 16GB"  # a new capacity: its largest batch is a search
        pending, text = w.headline, w.headline_html
        await asyncio.sleep(3 * AT_REST_DELAY_S)
        return pending, text, w.headline

    before, text, after = asyncio.run(move())
    assert before.largest_batch is None and "largest batch <span class='vw-pending'" in text
    assert before.fit_bytes == w.estimate.total_bytes  # on the CPU: known at once
    capacity = GPUS["T4 16GB"].memory_bytes
    cc = GPUS["T4 16GB"].compute_capability
    assert after.largest_batch == profile.max_batch_size(capacity, compute_capability=cc)
    w.batch_size = 9  # the same setting, another batch: the cached answer, at once
    assert w.headline.largest_batch == after.largest_batch


def test_a_refused_setting_keeps_the_last_state_and_says_why_in_the_headline() -> None:
    pytest.importorskip("peft")
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    profile = profile_model(model, input_size=(16,))
    w = MemoryWidget(profile, batch_size=4, optimizer="adamw")
    peak, y = w.estimate.peak_bytes, w.figure.data[PEAK].y
    w.lora_rank = 2  # PEFT has no default targets for a plain Sequential
    assert w.lora_rank == 0 and w.estimate.peak_bytes == peak
    assert tuple(w.figure.data[PEAK].y) == tuple(y)
    assert w.headline.error.startswith("could not profile")
    assert "target_modules" in w.headline.error and "kept lora_rank = 0" in w.headline.error
    assert "vw-error" in w.headline_html
    w.batch_size = 5  # the next move clears it
    assert w.headline.error == "" and "vw-error" not in w.headline_html


# --------------------------------------------------------------------------------------------
# The activation levers: checkpoint policy and loss chunks
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def decoder_profile() -> ModelProfile:
    # two DecoderBlocks: checkpoint="auto" wraps blocks.0 and blocks.1
    model = zoo.causal_decoder(vocab_size=64, d_model=32, n_head=2, n_layer=2, max_len=64)
    return profile_model(model, inputs=torch.zeros(2, 16, dtype=torch.long), device="cpu")


def test_checkpoint_policy_control_drives_the_estimate(decoder_profile: ModelProfile) -> None:
    from vram_widget._display.widget_controls import TOOLTIPS

    profile = decoder_profile
    w = MemoryWidget(profile, batch_size=4)
    dropdown, k_box = w._policy_dropdown, w._policy_k_box
    assert (dropdown.description, dropdown.tooltip) == (
        "checkpoint policy",
        TOOLTIPS["checkpoint_policy"],
    )
    assert (k_box.description, k_box.tooltip) == ("k", TOOLTIPS["checkpoint_policy_k"])
    assert list(dropdown.options) == ["off", "full", "op", "every k"]
    assert w.checkpoint_policy == "off" and k_box.layout.display == "none"

    def same(est: MemoryEstimate, **levers: object) -> None:
        expected = profile.estimate(4, **levers)  # type: ignore[arg-type]
        assert est.peak_bytes == expected.peak_bytes and est.flops == expected.flops
        assert est.levers == expected.levers

    # a policy with checkpointing off checkpoints the "auto" blocks, and the checkpoint
    # control says so (estimate() takes a policy alone as checkpoint="auto")
    dropdown.value = "full"
    assert (w.checkpoint, w.checkpoint_policy) == ("auto", "full")
    assert w._checkpoint_dropdown.value == "auto"
    same(w.estimate, checkpoint_policy="full")
    same(w.estimate, checkpoint="auto")
    dropdown.value = "every k"  # the box shows, and its k (2) is the policy
    assert w.checkpoint_policy == 2 and k_box.layout.display is None
    same(w.estimate, checkpoint_policy=2)
    assert w.estimate.levers.checkpoint_policy == 2
    assert w.estimate.levers.checkpoint == ("blocks.0", "blocks.1")  # the blocks it picks from
    k_box.value = 1
    assert w.checkpoint_policy == 1
    same(w.estimate, checkpoint_policy=1)
    k_box.value = 3  # 2 blocks: refused, kept, and the headline says why
    assert w.checkpoint_policy == 1 and k_box.value == 1
    assert "checkpoint_policy=3 checkpoints every 3rd block" in w.headline.error
    assert "kept checkpoint_policy = 1" in w.headline.error
    assert "vw-error" in w.headline_html
    same(w.estimate, checkpoint_policy=1)
    dropdown.value = "op"  # a profiling run of its own, behind the label
    assert w.checkpoint_policy == "op" and w.headline.error == ""
    assert "profiled" in w._status.value and "policy &#x27;op&#x27;" in w._status.value
    same(w.estimate, checkpoint_policy="op")
    assert _usable(w) and k_box.layout.display == "none"
    # checkpointing off turns the policy off, and the step has no levers
    w._checkpoint_dropdown.value = "off"
    assert (w.checkpoint, w.checkpoint_policy, dropdown.value) == ("off", "off", "off")
    assert not w.estimate.levers.active
    same(w.estimate)
    # checkpointing on with the policy off is "full"; the policy off turns it off again
    w.checkpoint = "DecoderBlock"
    assert w.checkpoint_policy == "full" and dropdown.value == "full"
    same(w.estimate, checkpoint="DecoderBlock")
    w.checkpoint_policy = "off"
    assert w.checkpoint == "off" and not w.estimate.levers.active


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("sometimes", r"checkpoint_policy='sometimes': the widget takes 'off', 'full', 'op'"),
        (0, r"checkpoint_policy=0: the widget takes"),
        (True, r"checkpoint_policy=True \(bool\)"),
        (5, r"checkpoint_policy=5 checkpoints every 5th block, and there are 2"),
    ],
)
def test_refused_checkpoint_policies(
    decoder_profile: ModelProfile, value: object, message: str
) -> None:
    w = MemoryWidget(decoder_profile, batch_size=4, checkpoint_policy="full")
    before = w.estimate
    with pytest.raises(traitlets.TraitError, match=message):
        w.checkpoint_policy = value
    assert w.checkpoint_policy == "full" and w.estimate is before


def test_a_policy_on_a_model_without_repeated_blocks_is_refused(profile: ModelProfile) -> None:
    w = MemoryWidget(profile)  # zoo.mlp: no repeated blocks, no "auto"
    with pytest.raises(traitlets.TraitError, match="checkpoint_policy='op' applies to the"):
        w.checkpoint_policy = "op"
    assert (w.checkpoint, w.checkpoint_policy) == ("off", "off")


def test_show_memory_starts_with_the_activation_levers() -> None:
    from models import hf_gpt2, hf_tokens

    pytest.importorskip("transformers")
    w = show_memory(
        hf_gpt2(), inputs=hf_tokens(2), device="cpu", loss_chunks=8, checkpoint_policy="op"
    )
    assert (w.loss_chunks, w.checkpoint_policy, w.checkpoint) == (8, "op", "auto")
    assert (w._chunks_dropdown.value, w._policy_dropdown.value) == (8, "op")
    expected = w.profile.estimate(32, loss_chunks=8, checkpoint_policy="op")
    assert w.estimate.peak_bytes == expected.peak_bytes
    assert w.estimate.levers == expected.levers
    # forms are checked before any profiling
    with pytest.raises(ValueError, match=r"invalid setting: checkpoint_policy='half'"):
        show_memory(_Broken(), input_size=(4,), checkpoint_policy="half")
    with pytest.raises(TypeError, match=r"invalid setting: loss_chunks=2.5 \(float\)"):
        show_memory(_Broken(), input_size=(4,), loss_chunks=2.5)


@pytest.fixture(scope="module")
def gpt2_profile() -> ModelProfile:
    from models import hf_gpt2, hf_tokens

    pytest.importorskip("transformers")
    torch.manual_seed(0)
    return profile_model(hf_gpt2(), inputs=hf_tokens(2, 16), device="cpu")


def test_loss_chunks_control_drives_the_estimate(gpt2_profile: ModelProfile) -> None:
    from vram_widget._display.widget_controls import TOOLTIPS

    profile = gpt2_profile
    w = MemoryWidget(profile, batch_size=2)
    dropdown = w._chunks_dropdown
    assert (dropdown.description, dropdown.tooltip) == ("loss chunks", TOOLTIPS["loss_chunks"])
    assert [label for label, _ in dropdown.options] == ["off", "2", "4", "8", "16"]
    assert not dropdown.disabled and w.loss_chunks is None
    plain = profile.estimate(2)
    dropdown.value = 4  # its own profiling run, behind the label
    assert w.loss_chunks == 4
    assert "profiled" in w._status.value and "output and loss in 4 chunks" in w._status.value
    expected = profile.estimate(2, loss_chunks=4)
    assert w.estimate.peak_bytes == expected.peak_bytes != plain.peak_bytes
    assert w.estimate.levers.loss_chunks == 4 and _usable(w)
    # a count off the list shows as its own choice
    w.loss_chunks = 3
    assert dropdown.value == 3 and ("3", 3) in dropdown.options
    assert w.estimate.peak_bytes == profile.estimate(2, loss_chunks=3).peak_bytes
    # more chunks than the 16 positions: refused from the trait, kept from the control
    with pytest.raises(traitlets.TraitError, match="into more chunks than it has positions"):
        w.loss_chunks = 17
    for refused in (0, True):
        with pytest.raises(traitlets.TraitError, match="loss_chunks"):
            w.loss_chunks = refused
    assert w.loss_chunks == 3
    # a shorter sequence than the chunks: the estimate refuses it, the length is kept
    w.seq_len = 2
    assert w.seq_len == 16 and "into more chunks than it has positions" in w.headline.error
    # data parallelism is not estimated with chunks: kept, and said
    w.gpus = 2
    assert w.gpus == 1 and "loss_chunks=3 with strategy='ddp' on 2 GPUs" in w.headline.error
    dropdown.value = 0  # off
    assert w.loss_chunks is None and w.estimate.peak_bytes == plain.peak_bytes


def test_loss_chunks_off_where_the_model_cannot_be_chunked(profile: ModelProfile) -> None:
    w = MemoryWidget(profile)  # zoo.mlp: not a causal LM
    dropdown = w._chunks_dropdown
    assert dropdown.disabled
    assert dropdown.tooltip.startswith("loss chunks: not available for this model: ")
    assert profile.loss_chunks_refusal in dropdown.tooltip
    with pytest.raises(traitlets.TraitError, match="loss_chunks=4 cannot be applied"):
        w.loss_chunks = 4
    w._set_busy(True)
    w._set_busy(False)  # a profiling run's end leaves it off
    assert dropdown.disabled


def test_a_recipe_starts_the_activation_lever_controls(gpt2_profile: ModelProfile) -> None:
    from vram_widget import Recipe
    from vram_widget._display.widget import SETTINGS
    from vram_widget._display.widget_recipe import CONTROLLED, recipe_settings

    assert set(CONTROLLED) <= set(SETTINGS)  # each held control is a trait
    recipe = Recipe().with_(batch_size=2, loss_chunks=4, checkpoint_policy="op")
    settings = recipe_settings(recipe)
    assert dict(settings.controls) == {"batch_size": 2, "loss_chunks": 4, "checkpoint_policy": "op"}
    assert dict(settings.fixed) == {}
    w = MemoryWidget(gpt2_profile, **settings.controls)
    assert (w.loss_chunks, w.checkpoint_policy, w.checkpoint) == (4, "op", "auto")
    assert w.estimate.peak_bytes == gpt2_profile.estimate(recipe=recipe).peak_bytes
    w._chunks_dropdown.value = 8  # a control now, not a held setting
    assert (
        w.estimate.peak_bytes
        == gpt2_profile.estimate(recipe=recipe.with_(loss_chunks=8)).peak_bytes
    )

    def policy(ctx: object, op: object, *args: object, **kwargs: object) -> object:
        return None

    with pytest.raises(ValueError, match=r"checkpoint_policy .*policy is a callable"):
        recipe_settings(Recipe().with_(checkpoint="auto", checkpoint_policy=policy))


@pytest.fixture(scope="module")
def cuda_profile() -> ModelProfile:
    return profile_model(zoo.mlp(), input_size=(784,))  # device="cuda": offloading applies


def test_offload_control_drives_the_estimate(cuda_profile: ModelProfile) -> None:
    from vram_widget._display.widget_controls import TOOLTIPS

    profile = cuda_profile
    w = MemoryWidget(profile, batch_size=1024)  # the activations make the peak
    dropdown = w._offload_dropdown
    assert (dropdown.description, dropdown.tooltip) == (
        "offload activations",
        TOOLTIPS["offload_activations"],
    )
    assert list(dropdown.options) == ["off", "torchtune", "save_on_cpu"]
    assert dropdown in w.control_groups["Memory levers"]
    assert not dropdown.disabled and w.offload_activations == "off"
    plain = profile.estimate(1024)
    assert plain.host_bytes == 0 and "Host" not in w.details_html
    for choice, label in (("save_on_cpu", "Host memory"), ("torchtune", "Host (pinned) memory")):
        dropdown.value = choice  # its own profiling run, behind the label
        assert w.offload_activations == choice and "profiled" in w._status.value
        expected = profile.estimate(1024, offload_activations=choice)
        assert w.estimate.peak_bytes == expected.peak_bytes < plain.peak_bytes
        assert w.estimate.host_bytes == expected.host_bytes > 0
        assert w.estimate.levers.offload_activations == choice and _usable(w)
        rows = dict(w._detail_rows(w.estimate))
        assert f"({expected.host_bytes:,} B)" in rows[label]
    # estimate's forms read as the control's: True is torchtune's, None and False off
    w.offload_activations = True
    assert w.offload_activations == "torchtune" and dropdown.value == "torchtune"
    with pytest.raises(traitlets.TraitError, match="offload_activations='nvme'"):
        w.offload_activations = "nvme"
    # a mode without a backward, and data parallelism: kept, and the headline says why
    w.mode = "inference"
    assert w.mode == "train" and "offload_activations='torchtune' with mode='inference'" in (
        w.headline.error
    )
    w.gpus = 2
    assert w.gpus == 1 and "on 2 GPUs: not estimated yet" in w.headline.error
    assert w.estimate.peak_bytes == profile.estimate(1024, offload_activations=True).peak_bytes
    for off in (None, False, "off"):
        w.offload_activations = "save_on_cpu"
        w.offload_activations = off
        assert w.offload_activations == "off" and dropdown.value == "off"
        assert w.estimate.peak_bytes == plain.peak_bytes and w.estimate.host_bytes == 0


def test_offload_control_off_on_a_cpu_profile(profile: ModelProfile) -> None:
    w = MemoryWidget(profile)  # device="cpu": the saved tensors are in host memory already
    dropdown = w._offload_dropdown
    assert dropdown.disabled and "not available on a CPU profile" in dropdown.tooltip
    with pytest.raises(traitlets.TraitError, match="on a device='cpu' profile"):
        w.offload_activations = "torchtune"
    before = w.estimate
    w._set_from_control("offload_activations", "save_on_cpu")  # a control's move: kept
    assert w.offload_activations == "off" and w.estimate is before
    assert "offload_activations = 'save_on_cpu' refused" in w.headline.error
    w._set_busy(True)
    w._set_busy(False)  # a profiling run's end leaves it off
    assert dropdown.disabled
    # refused before any profiling, as are forms no estimate takes
    with pytest.raises(ValueError, match="invalid setting: offload_activations='torchtune' on"):
        show_memory(_Broken(), input_size=(4,), device="cpu", offload_activations=True)
    with pytest.raises(ValueError, match="with mode='inference'"):
        show_memory(_Broken(), input_size=(4,), mode="inference", offload_activations=True)
    with pytest.raises(TypeError, match=r"invalid setting: offload_activations=2 \(int\)"):
        show_memory(_Broken(), input_size=(4,), offload_activations=2)


def test_a_recipe_starts_the_offload_control(cuda_profile: ModelProfile) -> None:
    from vram_widget import Recipe
    from vram_widget._display.widget_recipe import recipe_settings

    recipe = Recipe().with_(batch_size=1024, offload_activations=True)
    settings = recipe_settings(recipe)
    assert dict(settings.controls) == {"batch_size": 1024, "offload_activations": "torchtune"}
    assert dict(settings.fixed) == {}  # a control now, not a held setting
    # given here too in another of estimate's forms, it agrees; off does not
    w = show_memory(zoo.mlp(), input_size=(784,), recipe=recipe, offload_activations=True)
    with pytest.raises(ValueError, match="offload_activations=None conflicts with the recipe"):
        show_memory(_Broken(), input_size=(4,), recipe=recipe, offload_activations=None)
    expected = cuda_profile.estimate(recipe=recipe)
    assert w.offload_activations == "torchtune" and w._offload_dropdown.value == "torchtune"
    assert (w.estimate.peak_bytes, w.estimate.host_bytes) == (
        expected.peak_bytes,
        expected.host_bytes,
    )
    w._offload_dropdown.value = "save_on_cpu"
    moved = cuda_profile.estimate(recipe=recipe.with_(offload_activations="save_on_cpu"))
    assert (w.estimate.peak_bytes, w.estimate.host_bytes) == (moved.peak_bytes, moved.host_bytes)
    assert moved.peak_bytes != expected.peak_bytes  # save_on_cpu offloads the output's too


# torch.compile: the compile control and the partitioner's budget
# --------------------------------------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.cos(torch.sin(self.a(x))))


class _TwoBlocks(nn.Module):
    """Two repeated blocks in a ModuleList (compile="blocks" compiles each)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_compile_control_drives_the_estimate_behind_a_progress_label() -> None:
    from vram_widget._display.widget_compile import COMPILE_TOOLTIPS, NOT_SEARCHED

    profile = profile_model(_TwoBlocks(), input_size=(8,), device="cpu", cache=False)
    spy = _Spy(profile._source)
    profile._source = spy  # type: ignore[assignment]
    w = MemoryWidget(profile, batch_size=4, optimizer="sgd")
    spy.widget = w
    compile_, budget = w._compile_dropdown, w._budget_dropdown
    assert list(compile_.options) == ["off", "model", "blocks"]
    assert [v for _label, v in budget.options] == [1.0, 0.5, 0.1]
    assert (compile_.tooltip, budget.tooltip) == (
        COMPILE_TOOLTIPS["compile"],
        COMPILE_TOOLTIPS["activation_memory_budget"],
    )
    assert w.compile == "off" and budget.disabled and w._batch_slider.continuous_update

    def same(batch: int, **settings: Any) -> None:
        expected = profile.estimate(batch, optimizer="sgd", **settings)
        assert w.estimate.peak_bytes == expected.peak_bytes
        assert w.estimate.saved_bytes == expected.saved_bytes
        assert w.estimate.levers == expected.levers

    compile_.value = "model"  # a compiled run of its own, behind the label
    assert w.compile == "model" and not budget.disabled
    same(4, compile=True)
    assert not w.estimate.compile_bound and w.estimate.levers.compile_batch == 4
    assert spy.seen and all(busy for _r, _s, busy in spy.seen)
    assert all("profiling fp32 / train / sgd / torch.compile (model" in s for _r, s, _b in spy.seen)
    assert "profiled fp32 / train / sgd / torch.compile (model" in w._status.value
    assert _usable(w) and not w._batch_slider.continuous_update  # a move may profile
    # no search over the batch: each batch is a compiled run of its own
    assert w.headline.largest_batch is None
    assert f"largest batch {html.escape(NOT_SEARCHED)}" in w.headline_html
    assert f"Memory per extra sample</th><td>{html.escape(NOT_SEARCHED)}" in w.details_html
    # a new batch is profiled (the partition is decided at the batch), a known one is not
    n = len(spy.seen)
    w.batch_size = 5
    assert len(spy.seen) > n and "profiled" in w._status.value
    same(5, compile=True)
    n = len(spy.seen)
    w.batch_size = 4
    assert len(spy.seen) == n and w._status.value == ""
    same(4, compile=True)
    budget.value = 0.5
    assert w.activation_memory_budget == 0.5
    same(4, compile=True, activation_memory_budget=0.5)
    compile_.value = "blocks"
    same(4, compile="blocks", activation_memory_budget=0.5)
    w.mode = "inference"  # the compiled step is estimated in training: the eager pass here
    assert w.compile == "blocks"
    assert w.estimate.peak_bytes == profile.estimate(4, mode="inference").peak_bytes
    w.mode = "train"
    same(4, compile="blocks", activation_memory_budget=0.5)
    compile_.value = "off"
    assert budget.disabled and w._batch_slider.continuous_update and _usable(w)
    same(4)
    assert w.headline.largest_batch is not None


def test_compile_settings_refused_and_started() -> None:
    profile = profile_model(_TwoBlocks(), input_size=(8,), device="cpu", cache=False)
    w = MemoryWidget(profile, batch_size=2, optimizer="sgd", compile=True)
    assert w.compile == "model" and w.estimate.levers.compile == "model"
    with pytest.raises(traitlets.TraitError, match=r"outside \[0, 1\]"):
        w.activation_memory_budget = 1.5
    w._budget_dropdown.options = [*w._budget_dropdown.options, ("2.0", 2.0)]
    w._budget_dropdown.value = 2.0  # refused, kept, and the headline says why
    assert w.activation_memory_budget == 1.0 and w._budget_dropdown.value == 1.0
    assert "activation_memory_budget = 2.0 refused" in w.headline.error
    with pytest.raises(traitlets.TraitError, match="valid values are False or None"):
        w.compile = "max-autotune"
    # a pair the compiled step is not estimated with: kept, and the headline says why
    w.gpus = 2
    assert w.gpus == 1 and "not estimated" in w.headline.error
    # the forms are checked before the model runs
    with pytest.raises(ValueError, match="invalid setting: compile='inductor'"):
        show_memory(_TwoBlocks(), input_size=(8,), device="cpu", compile="inductor")
    with pytest.raises(ValueError, match=r"invalid setting: activation_memory_budget=-1"):
        show_memory(_TwoBlocks(), input_size=(8,), device="cpu", activation_memory_budget=-1)


def test_a_recipe_starts_the_compile_controls() -> None:
    from vram_widget import Recipe

    recipe = Recipe().with_(batch_size=2, optimizer="sgd", compile="blocks")
    recipe = recipe.with_(activation_memory_budget=0.3)
    profile = profile_model(_TwoBlocks(), input_size=(8,), device="cpu", cache=False)
    w = MemoryWidget(profile, **dict(_recipe_controls(recipe)))
    assert (w.compile, w.activation_memory_budget) == ("blocks", 0.3)
    assert w._budget_dropdown.value == 0.3  # a fraction not offered is added
    expected = profile.estimate(recipe=recipe)
    assert w.estimate.peak_bytes == expected.peak_bytes
    assert w.estimate.levers == expected.levers


def _recipe_controls(recipe: Any) -> Any:
    from vram_widget._display.widget_recipe import recipe_settings

    settings = recipe_settings(recipe)
    assert not settings.fixed  # both have controls
    return settings.controls.items()
