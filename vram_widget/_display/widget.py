"""The notebook widget: controls are traits; one observer -> estimate -> figure, in place.

No torch at import time: :func:`show_memory` imports the profiler when it is called. A control
move recomputes from the cached :class:`~vram_widget.ModelProfile` (numpy only) and writes into
the same ``go.FigureWidget`` inside ``batch_update()``; only the first use of a precision (or
an optimizer) not yet profiled runs the profiler once more, behind a "profiling…" label.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import functools
import html
import math
import os
import re
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets
import numpy as np
import plotly.graph_objects as go
import traitlets

from .._estimating.estimator import MemoryEstimate
from .._estimating.gpus import CUSTOM_GPU, GPUS, MIN_CAPACITY_BYTES, Gpu, custom_gpu, resolve_gpu
from .._estimating.levers import Levers
from .._estimating.options import Category, Device, Mode, Precision, optimizer_names
from .._estimating.profile import DEFAULT_MAX_SEQ_LEN
from .._estimating.recipe import Optimizer, Recipe
from .._estimating.sharding import (
    DEFAULT_GPUS_PER_NODE,
    SINGLE_DEVICE,
    STRATEGIES,
    resolve_parallel,
)
from .._estimating.stepping import stepping_levers
from .._estimating.tradeoff import Frontier
from .figures import (
    build_figure,
    build_frontier_figure,
    group_rows,
    output_shape_text,
    update_figure,
    update_frontier_figure,
)
from .optimizer_control import NO_OPTIMIZER, OptimizerControls, split_choice
from .plotly_widget import FigureWidget
from .widget_recipe import recipe_settings

if TYPE_CHECKING:
    import pandas as pd

    from .._estimating.profile import ModelProfile

__all__ = ["MemoryWidget", "format_bytes", "show_memory"]

BATCH_SLIDER_MAX = 8192
BATCH_MAX = 2**40
"""The largest batch the widget accepts (the exact box's bound and ``max_batch_size``'s limit)."""
# The sequence slider's top where the model has no learned position table: 128k tokens
SEQ_SLIDER_MAX = DEFAULT_MAX_SEQ_LEN
# new tokens a generation starts with (less where the model's positions run out first)
DEFAULT_NEW_TOKENS = 128
_NO_OPTIMIZER = NO_OPTIMIZER
_CHECKPOINT_OFF = "off"
_TABLE_ROWS = 25
# the GPUs slider's top (log scale, like the batch's)
GPUS_MAX = 1024
# the rest after a move before the lines that search run (a kernel: _schedule_at_rest)
AT_REST_DELAY_S = 0.15


def format_bytes(nbytes: int | float) -> str:
    """Bytes in binary units, three significant digits.

    Examples
    --------
    >>> format_bytes(3 * 2**30)
    '3.00 GiB'
    >>> format_bytes(512)
    '512 B'
    """
    value = float(nbytes)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            if unit == "B":
                return f"{sign}{int(value)} B"
            return f"{sign}{value:.3g} {unit}" if value >= 100 else f"{sign}{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def _format_count(n: float) -> str:
    """Large counts with an SI suffix (FLOPs, parameters)."""
    for scale, suffix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {suffix}"
    return f"{n:.0f} "


def _format_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} µs"


class _OptimizerTrait(traitlets.Unicode):
    """An optimizer name ``estimate`` takes (any of ``optimizer_names()`` when set, an
    implementation suffix included: ``"adamw-fused"``); ``None`` is stored as ``"none"``."""

    info_text = "an optimizer name of optimizer_names(), or None"

    def validate(self, obj: Any, value: Any) -> Any:
        if value is None:
            return _NO_OPTIMIZER
        valid = (*optimizer_names(), _NO_OPTIMIZER)
        key = value.strip().lower() if isinstance(value, str) else value
        if key not in valid:
            raise traitlets.TraitError(
                f"unknown optimizer {value!r}; valid values are "
                f"{', '.join(repr(n) for n in valid)}, or None"
            )
        return key


class MemoryWidget(widgets.VBox):
    """Interactive memory / FLOPs view of one profiled model (see :func:`show_memory`).

    Every control is a trait: setting ``w.batch_size = 64`` does what the slider does. The
    current estimate is ``w.estimate``, the figure ``w.figure`` (a ``go.FigureWidget``).
    """

    batch_size = traitlets.Int(32, min=1, max=BATCH_MAX)
    # tokens per sample; None where the profile has no sequence axis
    seq_len = traitlets.Int(None, allow_none=True)
    precision = traitlets.Enum([p.value for p in Precision], default_value="fp32")
    optimizer = _OptimizerTrait("adam")
    # how the optimizer steps: each parameter in its post-accumulate-grad hook during the
    # backward; and optimizer.zero_grad(set_to_none=...) (False: gradients kept, zeroed)
    optimizer_in_backward = traitlets.Bool(False)
    set_to_none = traitlets.Bool(True)
    mode = traitlets.Enum([m.value for m in Mode], default_value="train")
    # generation (mode "generate"): the tokens generated after the prompt, whose length is
    # seq_len (the sequence slider reads "prompt length" then)
    new_tokens = traitlets.Int(DEFAULT_NEW_TOKENS, min=1)
    gpu = traitlets.Enum([*GPUS, CUSTOM_GPU], default_value="H100 SXM 80GB")
    custom_gib = traitlets.Float(24.0)
    depth = traitlets.Int(1, min=0)
    # the batch x sequence-length frontier panel is open (where the profile has a sequence
    # axis): its figure is computed while open, and first opening it may profile lengths
    show_frontier = traitlets.Bool(False)
    # memory levers: "off", "auto" or a class name of repeated blocks; glob patterns of the
    # parameters that train, comma-separated ("" = as the model is); micro-batches per step
    checkpoint = traitlets.Unicode(_CHECKPOINT_OFF)
    trainable = traitlets.Unicode("")
    grad_accumulation = traitlets.Int(1, min=1)
    # LoRA adapters of this rank on PEFT's default targets (0: none)
    lora_rank = traitlets.Int(0, min=0)
    # the caching allocator replayed with expandable_segments:True (CUDA estimates)
    expandable_segments = traitlets.Bool(False)
    # data parallelism: ranks (1: one device) and how they share the step (sharding)
    gpus = traitlets.Int(1, min=1, max=GPUS_MAX)
    strategy = traitlets.Enum([s.value for s in STRATEGIES], default_value="ddp")
    # GPUs in one node: hsdp shards within a node and replicates across nodes (its control
    # shows with that strategy)
    gpus_per_node = traitlets.Int(DEFAULT_GPUS_PER_NODE, min=1, max=GPUS_MAX)

    def __init__(
        self,
        profile: ModelProfile,
        *,
        fixed_settings: Mapping[str, Any] | None = None,
        ignored: tuple[str, ...] = (),
        **settings: Any,
    ) -> None:
        self._profile = profile
        # a Recipe's settings that have no control (widget_recipe), passed to every estimate,
        # and what the config it was read from sets but the estimate leaves out
        self._fixed = dict(fixed_settings or {})
        self._ignored = ignored
        self._syncing = False
        self._reverting = False
        self._fit_cache: dict[tuple[Any, ...], int] = {}
        self._per_sample_cache: dict[tuple[Any, ...], int] = {}
        self._frontier_cache: dict[tuple[Any, ...], Frontier] = {}
        super().__init__()
        if profile.has_seq_axis and settings.get("seq_len") is None:
            settings = {**settings, "seq_len": profile.seq_len}
        limit = profile.generation_limit
        if "new_tokens" not in settings and limit is not None:
            # within the model's positions after the starting prompt
            prompt = settings.get("seq_len") or profile.seq_len or 0
            settings = {**settings, "new_tokens": max(1, min(DEFAULT_NEW_TOKENS, limit - prompt))}
        if "precision" not in settings and Precision.FP32 not in profile.precisions:
            # a model with a kernel that runs in some dtypes only: start where it runs
            settings = {**settings, "precision": profile.precisions[0].value}
        if "gpu" in settings:
            # any form a capacity takes: a catalog name, "80GiB", bytes (custom size)
            settings = {**settings, **_gpu_settings(settings["gpu"])}
        # Apply settings before any control exists, so a bad value raises TraitError here.
        with self.hold_trait_notifications():
            for name, value in settings.items():
                if not self.has_trait(name) or name not in _SETTINGS:
                    raise TypeError(
                        f"unknown setting {name!r}; valid settings are {', '.join(_SETTINGS)}"
                    )
                setattr(self, name, value)
        self._estimate = self._compute()
        self._figure = FigureWidget(
            build_figure(
                self._estimate,
                depth=self.depth,
                capacity_bytes=self.target.memory_bytes,
                gpu_name=self.target.name,
            )
        )
        self._build_controls()
        self._summary = widgets.HTML()
        # the device figure: allocator replays under caps, after the summary (below)
        self._device = widgets.HTML()
        # the fewest GPUs that fit (a search of estimates at several ranks), likewise
        self._parallel = widgets.HTML()
        self._gpus_cache: dict[tuple[Any, ...], int | None] = {}
        self._at_rest_pending: asyncio.TimerHandle | None = None
        self._table = widgets.HTML()
        self._status = widgets.HTML()
        self._csv_button = widgets.Button(
            description="Download CSV",
            icon="download",
            tooltip="the per-layer table of the current setting (w.to_csv())",
        )
        self._csv_button.on_click(self._show_csv_link)
        self._csv_link = widgets.HTML()
        self._render_text()
        panels = [
            widgets.Accordion(
                children=[
                    widgets.VBox([widgets.HBox([self._csv_button, self._csv_link]), self._table])
                ],
                titles=("Layers (largest first)",),
            )
        ]
        # The frontier panel, where lengths vary: an empty line until first opened.
        nothing = np.zeros(0, dtype=np.int64)
        self._frontier_figure = FigureWidget(
            build_frontier_figure(
                Frontier(0, nothing, nothing, complete=False),
                batch_size=self.batch_size,
                seq_len=self.seq_len or 1,
                max_batch_here=0,
            )
        )
        self._frontier_panel = widgets.Accordion(
            children=[self._frontier_figure],
            titles=("Batch x sequence length: what fits the GPU",),
            selected_index=None,
        )
        if self._profile.has_seq_axis:
            self._frontier_panel.observe(self._frontier_toggled, "selected_index")
            panels.insert(0, self._frontier_panel)
        self.children = [
            self._controls,
            self._status,
            self._figure,
            self._summary,
            self._device,
            self._parallel,
            *panels,
        ]
        self.observe(self._on_change, names=list(_SETTINGS))
        if self.show_frontier:
            self._on_change({"name": "show_frontier", "old": False, "new": True})

    # ------------------------------------------------------------------ public properties

    @property
    def estimate(self) -> MemoryEstimate:
        """The :class:`MemoryEstimate` the widget shows now."""
        return self._estimate

    @property
    def figure(self) -> go.FigureWidget:
        """The plotly ``FigureWidget`` (updated in place, never replaced)."""
        return self._figure

    @property
    def profile(self) -> ModelProfile:
        """The cached profile every estimate comes from."""
        return self._profile

    @property
    def target(self) -> Gpu:
        """The chosen accelerator (a catalog entry, or the custom size)."""
        if self.gpu == CUSTOM_GPU:
            return custom_gpu(self.custom_gib)
        return GPUS[self.gpu]

    @property
    def summary_html(self) -> str:
        """The summary panel's HTML."""
        return str(self._summary.value)

    @property
    def device_html(self) -> str:
        """The device line's HTML (CUDA): allocated -> reserved -> what the device needs;
        in a running kernel it says it is computing until the controls rest."""
        return str(self._device.value)

    def to_dataframe(self) -> pd.DataFrame:
        """Per-layer rows of the current estimate (one per module, plus loss and optimizer)."""
        return self._estimate.to_dataframe()

    def to_csv(self, path: str | None = None) -> str | None:
        """The per-layer table as CSV: written to ``path``, or returned as a string."""
        return self.to_dataframe().to_csv(path, index=False)

    @property
    def csv_filename(self) -> str:
        """The name the "Download CSV" link saves under: ``<model>_layers.csv``."""
        stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", self._profile.model_name or "model").strip("_.")
        return f"{stem or 'model'}_layers.csv"

    def _show_csv_link(self, _button: Any = None) -> None:
        """Build the CSV of the current estimate and show it as a download link.

        Built on the button's click, not on every move (the CSV of a 1,000-module model takes
        ~10 ms); a later move clears the link, so a stale table is never offered.
        """
        csv = self.to_csv() or ""
        payload = base64.b64encode(csv.encode("utf-8")).decode("ascii")
        name = html.escape(self.csv_filename, quote=True)
        self._csv_link.value = (
            f"<a download='{name}' href='data:text/csv;base64,{payload}' target='_blank'>"
            f"{name}</a> ({len(self._estimate.layers.name):,} rows, batch "
            f"{self._estimate.batch_size:,})"
        )

    # ------------------------------------------------------------------ validation

    @traitlets.validate("seq_len")
    def _valid_seq_len(self, proposal: dict[str, Any]) -> int | None:
        value = proposal["value"]
        if value is None and not self._profile.has_seq_axis:
            return None
        try:
            self._profile.check_seq_len(value if value is not None else 0)
        except (TypeError, ValueError) as exc:
            raise traitlets.TraitError(str(exc)) from None
        return int(value)

    @traitlets.validate("mode")
    def _valid_mode(self, proposal: dict[str, Any]) -> str:
        value = proposal["value"]
        if value == Mode.GENERATE.value and not self._profile.generates:
            raise traitlets.TraitError(
                "mode 'generate' needs a model that generates with a cache of past keys and "
                f"values (a Hugging Face model with generate()); "
                f"{self._profile.model_name or 'this model'} has none"
            )
        return str(value)

    @traitlets.validate("checkpoint", "trainable", "grad_accumulation", "lora_rank")
    def _valid_levers(self, proposal: dict[str, Any]) -> Any:
        value = proposal["value"]
        try:
            self._profile.levers(**self._lever_settings(**{proposal["trait"].name: value}))
        except (TypeError, ValueError) as exc:
            raise traitlets.TraitError(str(exc)) from None
        return value

    @traitlets.validate("custom_gib")
    def _valid_custom_gib(self, proposal: dict[str, Any]) -> float:
        value = float(proposal["value"])
        if not math.isfinite(value) or value * 2**30 < MIN_CAPACITY_BYTES:
            raise traitlets.TraitError(
                f"custom_gib must be a number of GiB of at least 1/1024 (1 MiB), got {value!r}"
            )
        return value

    # ------------------------------------------------------------------ update path

    def _settings(self) -> dict[str, Any]:
        return {
            "precision": self.precision,
            "optimizer": None if self.optimizer == _NO_OPTIMIZER else self.optimizer,
            **self._stepping_settings(),
            "mode": self.mode,
            "seq_len": self.seq_len,
            "new_tokens": self.new_tokens if self._generating else None,
            # The chosen GPU's, for the cuBLAS workspace in the extras (custom: default).
            "compute_capability": self.target.compute_capability,
            **self._lever_settings(),
            **({"expandable_segments": self.expandable_segments} if self._cuda else {}),
            "gpus": self.gpus,
            "strategy": self.strategy,
            "gpus_per_node": self.gpus_per_node,
            **self._fixed,
        }

    @property
    def _generating(self) -> bool:
        return self.mode == Mode.GENERATE.value

    @property
    def _cuda(self) -> bool:
        return self._profile.device is Device.CUDA

    def _lever_settings(self, **proposed: Any) -> dict[str, Any]:
        """The lever traits (or ``proposed`` values for some) as ``estimate`` takes them."""
        raw = {name: proposed.get(name, getattr(self, name)) for name in _LEVER_TRAITS}
        return {
            "checkpoint": _checkpoint_arg(raw["checkpoint"]),
            "trainable": _trainable_arg(raw["trainable"]),
            "grad_accumulation": raw["grad_accumulation"],
            "lora_rank": raw["lora_rank"] or None,
        }

    def _stepping_settings(self) -> dict[str, Any]:
        """How the optimizer steps, as ``estimate`` takes it (only where not torch's
        default, so the other settings' searches see the keywords they always did)."""
        return {
            **({"optimizer_in_backward": True} if self.optimizer_in_backward else {}),
            **({"set_to_none": False} if not self.set_to_none else {}),
        }

    def _levers(self) -> Levers:
        return self._profile.levers(**self._lever_settings())

    def _step_levers(self) -> Levers | None:
        """The levers with how the optimizer steps (in the backward, gradients kept), as the
        estimate runs them; None for a combination the estimate refuses (it says why,
        before any profiling)."""
        levers = self._levers()
        if self.mode != Mode.TRAIN.value:
            return levers
        try:
            record = Optimizer.parse(self._settings()["optimizer"])
            record = Optimizer(
                record.name,
                record.implementation,
                in_backward=self.optimizer_in_backward,
                set_to_none=self.set_to_none,
            )
            parallel = resolve_parallel(self.gpus, self.strategy, gpus_per_node=self.gpus_per_node)
            return stepping_levers(
                levers, record, record.resolved_implementation(self._profile.device), parallel
            )
        except ValueError:
            return None

    def _needs_profiling(self) -> bool:
        """Whether the current precision / optimizer (or, with the frontier open, the fit
        in the length) still has to be profiled (torch)."""
        levers = self._step_levers()
        if levers is None:  # refused by the estimate at once, nothing profiled
            return False
        try:  # FSDP2 under autocast steps on half parameters: a profiling run of its own
            parallel = resolve_parallel(self.gpus, self.strategy, gpus_per_node=self.gpus_per_node)
        except ValueError:  # the estimate says why
            parallel = SINGLE_DEVICE
        cached = self._profile.is_cached(
            self.precision, self.mode, self._settings()["optimizer"], self.seq_len, levers,
            parallel, self._settings()["new_tokens"],
        )  # fmt: skip
        if cached and self.mode == Mode.TRAIN.value and levers.active:
            # the summary compares with the same step without levers
            optimizer = self._settings()["optimizer"]
            cached = self._profile.is_cached(self.precision, self.mode, optimizer, self.seq_len)
        if self._frontier_shown() and self._frontier_key() not in self._frontier_cache:
            cached = cached and self._profile.length_fit_tried(self.precision, self.mode, levers)
        return not cached

    def _frontier_shown(self) -> bool:
        return self.show_frontier and self._profile.has_seq_axis

    def _settings_key(self, *leave_out: str, card: bool = True) -> tuple[Any, ...]:
        """Every setting an estimate takes (but ``leave_out``) and, with ``card``, the card's
        memory: the key of the caches of searches over one of them."""
        s = self._settings()
        kept = tuple(sorted((k, repr(v)) for k, v in s.items() if k not in leave_out))
        return (*kept, self.target.memory_bytes) if card else kept

    def _frontier_key(self) -> tuple[Any, ...]:
        return self._settings_key("seq_len")

    def frontier(self) -> Frontier:
        """The batch x sequence-length frontier of the current precision, optimizer, mode
        and GPU (:meth:`ModelProfile.frontier`; cached per setting, so moving the batch or
        the length only moves the marker)."""
        key = self._frontier_key()
        if key not in self._frontier_cache:
            s = self._settings()
            del s["seq_len"]
            capacity = self.target.memory_bytes
            if self._below_context(capacity):  # the summary says so; nothing fits anywhere
                lengths = np.asarray([self.seq_len or 1], dtype=np.int64)
                frontier = Frontier(capacity, lengths, np.zeros_like(lengths), complete=False)
            else:
                frontier = self._profile.frontier(capacity, **s)
            self._frontier_cache[key] = frontier
        return self._frontier_cache[key]

    def _below_context(self, capacity: int) -> bool:
        """Whether the CUDA context alone fills ``capacity`` (the API refuses such a
        capacity; the widget answers "nothing fits" and says why)."""
        return capacity <= self._estimate.extras.cuda_context_bytes  # the same at any setting

    def _compute(self) -> MemoryEstimate:
        return self._profile.estimate(self.batch_size, **self._settings())

    def _on_change(self, change: dict[str, Any]) -> None:
        """The one observer: any setting -> estimate -> figure and summary, in place.

        Where the setting needs a profiling run (torch, seconds), the status says so and the
        controls are disabled *before* it starts, and both are restored after it; on failure
        the setting goes back to its last value (traits stay the truth of what is shown).
        """
        profiling = self._needs_profiling()
        # the frontier of a new setting is a search with allocator replays at each length:
        # a second or two, so it gets the same label and disabled controls
        frontier_pending = (
            self._frontier_shown() and self._frontier_key() not in self._frontier_cache
        )
        levers = self._step_levers()
        what = html.escape(
            f"{self.precision} / {self.mode}"
            + (f" / {self.optimizer}" if self.mode == Mode.TRAIN.value else "")
            + (f" / {self.seq_len} tokens" if self.seq_len is not None else "")
            + (f" + {self.new_tokens} new" if self._generating else "")
            + (f" / {levers.describe()}" if levers is not None and levers.active else "")
        )
        started = 0.0
        if profiling or frontier_pending:
            doing = "profiling" if profiling else "computing the batch x length frontier for"
            self._status.value = f"<i>⏳ {doing} {what} (first use, runs once)…</i>"
            self._set_busy(True)
            started = time.perf_counter()
        try:
            est = self._compute()
            frontier = self.frontier() if self._frontier_shown() else None
        except Exception as exc:  # a failed extra profiling run: say so, keep the last view
            self._set_busy(False)
            self._revert(change)
            self._status.value = (
                f"<span style='color:#b00'>could not {'profile' if profiling else 'estimate'} "
                f"{what}: "
                f"{html.escape(f'{type(exc).__name__}: {exc}')}; kept {change['name']} = "
                f"{html.escape(repr(change['old']))}</span>"
            )
            return
        if profiling or frontier_pending:
            self._set_busy(False)
            elapsed = _format_seconds(time.perf_counter() - started)
            done = "profiled" if profiling else "computed the frontier for"
            self._status.value = f"<i>{done} {what} in {elapsed}</i>"
        elif self._status.value:
            self._status.value = ""
        if self._csv_link.value:
            self._csv_link.value = ""
        self._estimate = est
        target = self.target
        update_figure(
            self._figure,
            est,
            depth=self.depth,
            capacity_bytes=target.memory_bytes,
            gpu_name=target.name,
        )
        if frontier is not None:
            self._draw_frontier(frontier)
        self._sync_controls()
        self._render_text()

    def _draw_frontier(self, frontier: Frontier) -> None:
        assert self.seq_len is not None
        target = self.target
        opt = f", {self.optimizer}" if self.mode == Mode.TRAIN.value else ""
        update_frontier_figure(
            self._frontier_figure,
            frontier,
            batch_size=self.batch_size,
            seq_len=self.seq_len,
            max_batch_here=self.largest_batch(),
            title=(
                f"Largest batch per length on {target.name} ({format_bytes(target.memory_bytes)}"
                f"): {self.precision}{opt}, {self.mode}"
            ),
        )

    def _frontier_toggled(self, change: dict[str, Any]) -> None:
        if not self._syncing:
            self.show_frontier = change["new"] is not None

    def _revert(self, change: dict[str, Any]) -> None:
        """Put a setting whose estimate failed back to its last value (re-renders that)."""
        name = change.get("name")
        if self._reverting or name not in _SETTINGS or change.get("old") is None:
            return  # never bounce between two settings that both fail
        self._reverting = True
        try:
            setattr(self, name, change["old"])
        finally:
            self._reverting = False

    def _set_busy(self, busy: bool) -> None:
        """Disable every control while a profiling run blocks the kernel; re-enable after."""
        for control in self._control_widgets:
            control.disabled = busy
        if not busy:
            self._custom_box.disabled = self.gpu != CUSTOM_GPU
            self._optimizer_controls.enable()

    # ------------------------------------------------------------------ derived numbers

    def largest_batch(self) -> int:
        """The largest batch whose peak plus extras fits the chosen device (0: none fits).

        Cached per (precision, optimizer, mode, GPU): a batch-size move costs nothing.
        """
        s = self._settings()
        capacity = self.target.memory_bytes
        key = self._settings_key()
        if key not in self._fit_cache:
            self._fit_cache[key] = (
                0 if self._below_context(capacity) else self._profile.max_batch_size(capacity, **s)
            )
        return self._fit_cache[key]

    def bytes_per_sample(self) -> int:
        """How much the peak grows per extra sample (cached per precision/optimizer/mode)."""
        key = self._settings_key("compute_capability", card=False)
        if key not in self._per_sample_cache:
            settings = self._settings()
            del settings["compute_capability"]  # the extras do not grow with the batch
            self._per_sample_cache[key] = self._profile.bytes_per_sample(**settings)
        return self._per_sample_cache[key]

    # ------------------------------------------------------------------ rendering

    def _render_text(self) -> None:
        self._summary.value = self._summary_html()
        self._table.value = self._table_html()
        self._schedule_at_rest()

    def _schedule_at_rest(self) -> None:
        """The lines that wait for the controls to rest, after the figure and summary.

        ``device_bytes`` is a search of allocator replays under caps (5-30 ms for ResNet-50)
        and the fewest GPUs a search of estimates at several ranks: more than a slider move
        may take. So in a running kernel they are filled in once the controls rest for
        ``AT_REST_DELAY_S`` (a new move cancels a pending one); with no event loop (a
        script, a test) at once."""
        if self._at_rest_pending is not None:
            self._at_rest_pending.cancel()
            self._at_rest_pending = None
        est = self._estimate
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._fill_at_rest(est)
            return
        if est.allocator is not None:
            self._device.value = "<b>On the device</b>: <i>replaying the allocator under caps…</i>"
        if est.mode is Mode.TRAIN:
            self._parallel.value = "<b>GPUs needed</b>: <i>searching…</i>"
        self._at_rest_pending = loop.call_later(AT_REST_DELAY_S, self._fill_at_rest, est)

    def _fill_at_rest(self, est: MemoryEstimate) -> None:
        """The lines that wait for the controls to rest: the device line and the fewest
        GPUs that fit."""
        self._at_rest_pending = None
        if est is not self._estimate:  # a setting moved away from since
            return
        self._device.value = "" if est.allocator is None else self._device_html(est)
        self._parallel.value = self._min_gpus_html(est)

    @property
    def parallel_html(self) -> str:
        """The "GPUs needed" line's HTML (training): the fewest GPUs of the chosen card on
        which the current setting fits, per rank, with the chosen strategy."""
        return str(self._parallel.value)

    def min_gpus(self) -> int | None:
        """:meth:`ModelProfile.min_gpus` at the current setting and card (cached)."""
        s = self._settings()
        s.pop("gpus")
        capacity = self.target.memory_bytes
        key = (self.batch_size, *self._settings_key("gpus"))
        if key not in self._gpus_cache:
            if self._below_context(capacity):
                self._gpus_cache[key] = None
            else:
                strategy = s.pop("strategy")
                del s["mode"]
                self._gpus_cache[key] = self._profile.min_gpus(
                    capacity, self.batch_size, strategy=strategy, **s
                )
        return self._gpus_cache[key]

    def _min_gpus_html(self, est: MemoryEstimate) -> str:
        if est.mode is not Mode.TRAIN:
            return ""
        card = html.escape(self.target.name)
        try:
            needed = self.min_gpus()
        except ValueError as exc:  # more than one GPU, where a setting is one GPU's only
            return (
                f"<b>GPUs needed</b>: more than one {card} at batch {self.batch_size:,}; "
                f"{html.escape(str(exc))}"
            )
        if needed is None:
            return (
                f"<b>GPUs needed</b>: no number up to {GPUS_MAX:,} fits {card} with "
                f"{self.strategy} at batch {self.batch_size:,} per GPU ("
                + (
                    "DDP keeps the whole model, its gradients and optimizer state on every "
                    "GPU; zero1 shards the optimizer state)"
                    if self.strategy == "ddp"
                    else "the state it shards is not what fills the card)"
                )
            )
        return (
            f"<b>GPUs needed</b>: {needed:,} x {card} with {self.strategy} at batch "
            f"{self.batch_size:,} per GPU (global batch {needed * self.batch_size:,})"
        )

    def _device_html(self, est: MemoryEstimate) -> str:
        """Allocated -> reserved -> device: the third of the three numbers (CUDA)."""
        device = est.device_bytes
        replayed = est.allocator
        assert device is not None and replayed is not None
        context = est.extras.cuda_context_bytes
        capacity = self.target.memory_bytes
        share = f" ({device / capacity:.0%} of {html.escape(self.target.name)})"
        return (
            f"<b>On the device</b> (what an out-of-memory error decides on): "
            f"<b>{format_bytes(device)}</b>{share} = the least the caching allocator can "
            f"reserve and still run the step, releasing its cached segments "
            f"({format_bytes(device - context)}), + the CUDA context "
            f"({format_bytes(context)}). Allocated {format_bytes(est.peak_bytes)} -> reserved "
            f"{format_bytes(replayed.peak_reserved_bytes)} (nothing released) -> device"
        )

    def _summary_html(self) -> str:
        est = self._estimate
        target = self.target
        capacity = target.memory_bytes
        fits = est.fits(capacity)  # the device basis on CUDA (the replayed allocator)
        largest = self.largest_batch()
        lines = [
            f"<b>{html.escape(self._profile.model_name or 'model')}</b>: "
            f"{self._profile.param_count:,} parameters "
            f"({self._profile.trainable_param_count:,} trainable); {est.mode.value}, batch "
            f"{est.batch_size:,} (inputs: {html.escape(self._profile.input_shape)}), "
            f"{est.precision.value}{self._optimizer_text(est)}, for "
            f"{est.device.value} kernels",
            f"<b>Peak</b>: {format_bytes(est.peak_bytes)} ({est.peak_bytes:,} B) in "
            f"{html.escape(est.peak_location)}",
        ]
        if est.levers.active:
            lines.append(self._levers_line(est))
        if est.gpus > 1:
            which = f"rank {est.rank}" if est.rank is not None else "each rank"
            lines.append(
                f"<b>Data parallel</b>: {est.gpus:,} GPUs, {est.strategy}; shown: {which} "
                f"(the peak per GPU), with {format_bytes(est.communication_bytes)} of "
                f"communication buffers; global batch {est.gpus:,} x {est.batch_size:,} = "
                f"{est.gpus * est.batch_size:,}"
                + (
                    f"; beside the totals, NCCL's own buffers ~{format_bytes(est.nccl.nbytes)} "
                    f"(outside the allocator: {html.escape(est.nccl.describe())})"
                    if est.nccl is not None
                    else ""
                )
            )
        generation = est.generation
        if generation is not None:
            lines.insert(1, self._generation_line(est))
        elif est.seq_len is not None:
            lines.insert(
                1,
                f"<b>Tokens per step</b>: {est.batch_size:,} x {est.seq_len:,} = "
                f"{est.batch_size * est.seq_len:,}",
            )
        parts = [
            f"{c.value} {format_bytes(est.peak_breakdown.get(c, 0))}"
            for c in Category
            if est.peak_breakdown.get(c, 0)
        ]
        lines.append("<b>At the peak</b>: " + ", ".join(parts))
        x = est.extras
        lines.append(
            f"<b>Extras</b> (reserve): CUDA context {format_bytes(x.cuda_context_bytes)}"
            + (
                f' <span title="{html.escape(x.cuda_context_source)}">'
                f"({html.escape(x.cuda_context_source.partition(':')[0])})</span>"
                if x.cuda_context_source
                else ""
            )
            + ", "
            f"cuBLAS workspace {format_bytes(x.cublas_workspace_bytes)}, allocator rounding "
            f"{format_bytes(x.allocator_rounding_bytes)}; allocated + extras "
            f"{format_bytes(est.total_bytes)}"
            # what "fits" compares with the card: this on the CPU, the device line on CUDA
             + (" (the number compared with the card)" if est.allocator is None else "")
        )
        ignored = (*self._ignored, *est.ignored)
        if ignored:  # what the setup runs that the estimate leaves out, never dropped
            lines.append("<b>Not estimated</b>: " + "; ".join(html.escape(i) for i in ignored))
        allocator_line = self._allocator_line(est)
        if allocator_line:
            lines.append(allocator_line)
        # On CUDA, "fits" is the allocator replayed under the capacity less the context (no
        # out-of-memory error); what is used at its peak is the reserved memory plus the
        # context, as nvidia-smi would show it. On the CPU: the allocated peak.
        used = est.total_bytes
        if est.allocator is not None:
            used = est.allocator.peak_reserved_bytes + est.extras.cuda_context_bytes
        verdict = (
            f"<span style='color:#080'><b>fits</b></span> {html.escape(target.name)} "
            f"({format_bytes(capacity)}; {used / capacity:.0%} used at the peak"
            f"{', reserved + context' if est.allocator is not None else ''})"
            if fits
            else f"<span style='color:#b00'><b>does not fit</b></span> "
            f"{html.escape(target.name)} ({format_bytes(capacity)}"
            f"{': the replayed allocator runs out of memory' if est.allocator else ''})"
        )
        context = est.extras.cuda_context_bytes
        if capacity < context:
            verdict += f"; the capacity is below the CUDA context alone ({format_bytes(context)})"
        elif largest == 0:
            verdict += "; not even batch size 1 fits"
        elif generation is not None:
            verdict += f"; most sequences generated at once: <b>{largest:,}</b>"
        else:
            verdict += f"; largest batch that fits: <b>{largest:,}</b>"
        lines.append(verdict)
        sample = "sequence" if generation is not None else "sample"
        lines.append(f"<b>Memory per extra {sample}</b>: {format_bytes(self.bytes_per_sample())}")
        lines.append(
            f"<b>FLOPs {'of the generation' if generation is not None else 'per step'}</b>: "
            f"{_format_count(est.flops)}FLOP "
            f"({_format_count(est.macs)}MAC; forward {_format_count(est.flops_forward)}FLOP, "
            f"backward {_format_count(est.flops_backward)}FLOP)"
        )
        rate = target.peak_flops_per_s(self.precision)
        if rate:
            t = est.flops / rate
            speed = f"{est.batch_size / t:,.0f} samples/s" if t > 0 else "n/a"
            if generation is not None and t > 0:  # compute-bound; decoding rarely is
                speed = f"{est.batch_size * generation.new_tokens / t:,.0f} new tokens/s"
            lines.append(
                f"<b>{'Generation' if generation is not None else 'Step'} time</b> &ge; "
                f"{_format_seconds(t)} at {rate / 1e12:g} TFLOP/s "
                f"(dense peak); at most {speed}"
            )
        else:
            lines.append("<b>Step time</b>: no FLOP rate for this device")
        if not est.exact:
            lines.append(
                "<i>memory is not a polynomial the profile could verify in the batch size for "
                "this model: estimates away from the profiled batches are extrapolated</i>"
            )
        return "<br>".join(lines)

    def _optimizer_text(self, est: MemoryEstimate) -> str:
        """The optimizer of a training estimate, the implementation that ran (the one asked,
        or torch's default on the device) and how it steps, where not the default."""
        if not est.optimizer:
            return ""
        text = f", optimizer {est.optimizer.value}"
        impl = est.optimizer_implementation
        if impl is not None:
            asked = split_choice(self.optimizer)[1] is not None
            text += f" ({impl}" + ("" if asked else f": torch's default on {est.device.value}")
            text += ")"
        if est.levers.in_backward is not None:
            text += ", stepped in the backward (each parameter in its gradient's hook)"
        if not est.levers.set_to_none:
            text += ", gradients kept between steps (zero_grad(set_to_none=False))"
        return html.escape(text, quote=False)

    def _generation_line(self, est: MemoryEstimate) -> str:
        """A generation's shape, its KV cache and the step of its peak."""
        generation = est.generation
        assert generation is not None
        prompt = est.seq_len or 0
        step = (
            "the prefill of the prompt"
            if not est.peak_step
            else f"decode step {est.peak_step:,} of {generation.new_tokens - 1:,}"
        )
        return (
            f"<b>Generation</b>: {est.batch_size:,} sequences x (a prompt of {prompt:,} "
            f"tokens + {generation.new_tokens:,} new); <b>KV cache</b> "
            f"{format_bytes(generation.kv_cache_bytes)} after the last step, "
            f"{format_bytes(generation.kv_cache_bytes_per_token)} per token per sequence; "
            f"the peak is in {step}"
        )

    def _allocator_line(self, est: MemoryEstimate) -> str:
        """The caching allocator's view (CUDA): what it reserves at its peak, the gap to
        the whole blocks in use, and the other expandable_segments setting; empty on CPU."""
        shown = est.allocator
        other = est.replayed(expandable_segments=not est.expandable_segments)
        if shown is None or other is None:
            return ""
        gap = shown.peak_reserved_bytes - shown.peak_allocated_bytes
        delta = other.peak_reserved_bytes - shown.peak_reserved_bytes
        setting = "expandable_segments:" + ("False" if est.expandable_segments else "True")
        return (
            f"<b>Reserved</b> (caching allocator replayed"
            f"{', expandable segments' if est.expandable_segments else ''}; not yet checked on "
            f"a GPU): {format_bytes(shown.peak_reserved_bytes)} at its peak for "
            f"{format_bytes(shown.peak_allocated_bytes)} of whole blocks in use; "
            f"{format_bytes(gap)} is fragmentation and segment rounding; with {setting}: "
            f"{format_bytes(other.peak_reserved_bytes)} ({'+' if delta >= 0 else '-'}"
            f"{format_bytes(abs(delta))})"
        )

    def _levers_line(self, est: MemoryEstimate) -> str:
        """What the active levers save and cost against the same step without them."""
        plain = {*self._lever_settings(), *_STEPPING_SETTINGS}
        settings = {k: v for k, v in self._settings().items() if k not in plain}
        base = self._profile.estimate(self.batch_size, **settings)
        saved = base.peak_bytes - est.peak_bytes
        change = "saves" if saved >= 0 else "adds"
        flops = est.flops / base.flops - 1 if base.flops else 0.0
        line = (
            f"<b>Levers</b> ({html.escape(est.levers.describe())}): {change} "
            f"{format_bytes(abs(saved))} at the peak ({format_bytes(base.peak_bytes)} without), "
            f"FLOPs {flops:+.0%}"
        )
        if est.levers.grad_accumulation > 1:
            k = est.levers.grad_accumulation
            line += f"; effective batch {k} x {est.batch_size:,} = {k * est.batch_size:,}"
        return line

    def _table_html(self) -> str:
        """The largest module groups at the current depth (numpy ranking, few rows)."""
        layers = self._estimate.layers
        groups = group_rows(layers.depth, self.depth)
        n = len(groups)
        cols = {
            "params": layers.param_count,
            "param B": layers.param_bytes,
            "grad B": layers.gradient_bytes,
            "opt state B": layers.optimizer_state_bytes,
            "activation B": layers.activation_bytes,
            "fwd FLOPs": layers.flops_forward,
            "bwd FLOPs": layers.flops_backward,
        }
        sums = {k: np.bincount(groups, weights=v, minlength=n) for k, v in cols.items()}
        total = sums["param B"] + sums["grad B"] + sums["opt state B"] + sums["activation B"]
        heads = np.flatnonzero(groups == np.arange(n))
        order = heads[np.argsort(-total[heads], kind="stable")][:_TABLE_ROWS]
        heads_row = ("module", "type", "output", "activations", *cols)
        head = "".join(f"<th>{h}</th>" for h in heads_row)
        body = []
        numel = layers.output_numel
        for i, shape in zip(order.tolist(), output_shape_text(layers, order), strict=True):
            cells = [
                html.escape(layers.name[i] or "(model)"),
                html.escape(layers.type[i]),
                html.escape(shape),
                f"{int(numel[i]):,}" if shape else "",
                *(f"{round(sums[k][i]):,}" for k in cols),
            ]
            body.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
        return (
            f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
            f"<p>{len(heads)} groups at depth {self.depth}; activations: elements of the "
            f"group's output at this batch; full table: "
            f"<code>w.to_dataframe()</code> / <code>w.to_csv(path)</code></p>"
        )

    # ------------------------------------------------------------------ controls

    def _build_controls(self) -> None:
        self._batch_slider, self._batch_box = _log_slider_and_box(
            "batch size", self.batch_size, BATCH_SLIDER_MAX, BATCH_MAX, continuous=True
        )
        self._batch_slider.observe(functools.partial(self._control_moved, "batch_size"), "value")
        self._batch_box.observe(functools.partial(self._control_moved, "batch_size"), "value")
        # The sequence length, where the profile has a sequence axis: a log slider like the
        # batch's, up to the model's learned positions (else 128k tokens), and a box. A move
        # may profile (the first other length), so the slider reports on release.
        seq_max = self._profile.seq_len_limit or SEQ_SLIDER_MAX
        self._seq_slider, self._seq_box = _log_slider_and_box(
            "prompt length" if self._generating else "sequence length",
            self.seq_len or 1,
            seq_max,
            seq_max,
            continuous=False,
        )
        self._seq_slider.observe(functools.partial(self._control_moved, "seq_len"), "value")
        self._seq_box.observe(functools.partial(self._control_moved, "seq_len"), "value")
        self._seq_row = widgets.HBox(
            [self._seq_slider, self._seq_box],
            layout={"display": None if self._profile.has_seq_axis else "none"},
        )
        precision = widgets.Dropdown(
            options=list(self.traits()["precision"].values or []), layout={"width": "200px"}
        )
        # the optimizer, its implementation, and how it steps (two checkboxes)
        self._optimizer_controls = OptimizerControls(self, self._profile.device)
        optimizer, implementation, in_backward, keep_grads = self._optimizer_controls.widgets
        # generation where the model generates with a KV cache
        modes = [m.value for m in Mode if m is not Mode.GENERATE or self._profile.generates]
        mode = widgets.ToggleButtons(options=modes, style={"button_width": "90px"})
        # Generation: the new tokens after the prompt (a log slider and a box, up to the
        # model's positions); the prompt is the sequence slider, relabelled.
        tokens_max = self._profile.generation_limit or SEQ_SLIDER_MAX
        self._tokens_slider, self._tokens_box = _log_slider_and_box(
            "new tokens", self.new_tokens, tokens_max, tokens_max, continuous=False
        )
        self._tokens_slider.observe(functools.partial(self._control_moved, "new_tokens"), "value")
        self._tokens_box.observe(functools.partial(self._control_moved, "new_tokens"), "value")
        self._generation_row = widgets.HBox(
            [widgets.HTML("<b>generation</b>&nbsp;"), self._tokens_slider, self._tokens_box],
            layout={"display": None if self._generating else "none"},
        )
        gpu = widgets.Dropdown(options=[*GPUS, CUSTOM_GPU], layout={"width": "300px"})
        custom = widgets.BoundedFloatText(
            min=0.001, max=1e6, layout={"width": "170px"}, disabled=self.gpu != CUSTOM_GPU
        )
        max_depth = (
            int(self._estimate.layers.depth.max()) if len(self._estimate.layers.depth) else 0
        )
        depth = widgets.IntSlider(min=0, max=max(max_depth, 1), description="group depth")
        # The memory levers: checkpointing ("auto" where the model has repeated blocks, and
        # each class with repeated instances), the parameters that train, accumulation.
        types = self._profile.rows.types[:-2]
        repeated = sorted({t for t in types[1:] if types.count(t) > 1})
        auto = ["auto"] if self._profile.checkpoint_blocks else []
        options = [_CHECKPOINT_OFF, *auto, *repeated]
        if self.checkpoint not in options:
            options.append(self.checkpoint)
        checkpoint = widgets.Dropdown(options=options, layout={"width": "260px"})
        trainable = widgets.Text(
            placeholder="all (or patterns: head.*, *.bias)",
            continuous_update=False,
            layout={"width": "300px"},
        )
        accumulation = widgets.BoundedIntText(min=1, max=1 << 20, layout={"width": "190px"})
        lora = widgets.BoundedIntText(
            min=0, max=4096, layout={"width": "170px"}, tooltip="0: no LoRA (PEFT's targets)"
        )
        expandable = widgets.Checkbox(
            description="expandable_segments",
            indent=False,
            layout={"width": "190px"},
            tooltip="replay the caching allocator with PYTORCH_CUDA_ALLOC_CONF="
            "expandable_segments:True",
        )
        if self._profile.device is not Device.CUDA:  # no caching allocator to replay
            expandable.layout.display = "none"
        # Data parallelism: the ranks (a log slider like the batch's, and a box) and the
        # strategy; a rank's estimate is shown, its batch per rank.
        self._gpus_slider, self._gpus_box = _log_slider_and_box(
            "GPUs", self.gpus, GPUS_MAX, GPUS_MAX, continuous=False
        )
        self._gpus_slider.observe(functools.partial(self._control_moved, "gpus"), "value")
        self._gpus_box.observe(functools.partial(self._control_moved, "gpus"), "value")
        strategy = widgets.Dropdown(
            options=list(self.traits()["strategy"].values or []), layout={"width": "200px"}
        )
        self._per_node_box = widgets.BoundedIntText(
            min=1, max=GPUS_MAX, layout={"width": "150px"}, tooltip="hsdp: GPUs in one node"
        )
        for control, name, label in (
            (precision, "precision", "precision"),
            (mode, "mode", "mode"),
            (gpu, "gpu", "GPU"),
            (custom, "custom_gib", "custom GiB"),
            (depth, "depth", ""),
            (checkpoint, "checkpoint", "checkpointing"),
            (trainable, "trainable", "trainable"),
            (accumulation, "grad_accumulation", "micro-batches"),
            (lora, "lora_rank", "LoRA rank"),
            (expandable, "expandable_segments", ""),
            (strategy, "strategy", "strategy"),
            (self._per_node_box, "gpus_per_node", "per node"),
        ):
            if label:
                control.description = label
            # Labels as wide as their text, so no control wraps under its own label.
            control.style.description_width = "initial"
            widgets.link((self, name), (control, "value"))
        self._custom_box = custom
        self._control_widgets: tuple[widgets.DOMWidget, ...] = (
            self._batch_slider,
            self._batch_box,
            self._seq_slider,
            self._seq_box,
            precision,
            *self._optimizer_controls.widgets,
            mode,
            gpu,
            custom,
            depth,
            checkpoint,
            trainable,
            accumulation,
            lora,
            expandable,
            self._gpus_slider,
            self._gpus_box,
            strategy,
            self._per_node_box,
            self._tokens_slider,
            self._tokens_box,
        )
        self._parallel_row = widgets.HBox(
            [
                widgets.HTML("<b>data parallel</b>&nbsp;"),
                self._gpus_slider,
                self._gpus_box,
                strategy,
                self._per_node_box,
            ]
        )
        self._levers_row = widgets.HBox(
            [
                widgets.HTML("<b>memory levers</b>&nbsp;"),
                checkpoint,
                trainable,
                accumulation,
                lora,
                in_backward,
                keep_grads,
            ]
        )
        self._controls = widgets.VBox(
            [
                # the step's shape, then what is stored and run, then the levers that trade
                # compute for memory, then the device
                widgets.HBox([self._batch_slider, self._batch_box]),
                self._seq_row,
                widgets.HBox([precision, optimizer, implementation, mode]),
                self._generation_row,
                self._levers_row,
                widgets.HBox([gpu, custom, expandable, depth]),
                self._parallel_row,
            ]
        )

    def _control_moved(self, name: str, change: dict[str, Any]) -> None:
        """A slider or box of an integer setting moved: set the trait (never feeding back
        while the controls are synced to the traits)."""
        if not self._syncing and getattr(self, name) is not None:
            setattr(self, name, max(1, round(change["new"])))

    def _sync_controls(self) -> None:
        """Show the batch size on the slider and the box without feeding back."""
        self._syncing = True
        try:
            self._batch_slider.value = float(min(self.batch_size, BATCH_SLIDER_MAX))
            self._batch_box.value = self.batch_size
            if self.seq_len is not None:
                self._seq_slider.value = float(self.seq_len)
                self._seq_box.value = self.seq_len
            self._gpus_slider.value = float(self.gpus)
            self._gpus_box.value = self.gpus
            self._tokens_slider.value = float(self.new_tokens)
            self._tokens_box.value = self.new_tokens
            self._seq_slider.description = (
                "prompt length" if self._generating else "sequence length"
            )
            self._generation_row.layout.display = None if self._generating else "none"
            self._per_node_box.layout.display = None if self.strategy == "hsdp" else "none"
            self._frontier_panel.selected_index = 0 if self._frontier_shown() else None
        finally:
            self._syncing = False
        self._custom_box.disabled = self.gpu != CUSTOM_GPU

    # ------------------------------------------------------------------ static fallback

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        """The widget view where widgets run, plus a static figure and summary as HTML for
        front ends that cannot run widgets (nbviewer, GitHub, exported notebooks)."""
        bundle: dict[str, Any] = dict(super()._repr_mimebundle_(**kwargs) or {})
        bundle["text/html"] = self.static_html()
        return bundle

    def static_html(self) -> str:
        """The figure (plotly.js from the CDN) and the summary as one HTML fragment."""
        fig = go.Figure(self._figure)
        return (
            fig.to_html(include_plotlyjs="cdn", full_html=False)
            + f"<div>{self._summary.value}</div>"
            + (f"<div>{self._device_html(self._estimate)}</div>" if self._device.value else "")
        )


_LEVER_TRAITS = ("checkpoint", "trainable", "grad_accumulation", "lora_rank")
# how the optimizer steps (estimate's keywords, the widget's traits)
_STEPPING_SETTINGS = ("optimizer_in_backward", "set_to_none")


def _checkpoint_arg(value: str) -> str | None:
    """The ``checkpoint`` trait as ``estimate`` takes it ("off": None)."""
    return None if value in (_CHECKPOINT_OFF, "") else value


def _trainable_arg(value: str) -> list[str] | None:
    """The ``trainable`` trait (comma-separated patterns) as ``estimate`` takes it."""
    patterns = [p.strip() for p in value.split(",") if p.strip()]
    return patterns or None


def _log_slider_and_box(
    description: str, value: int, slider_max: int, box_max: int, *, continuous: bool
) -> tuple[widgets.FloatLogSlider, widgets.BoundedIntText]:
    """A base-2 log slider from 1 to ``slider_max`` in quarter steps, and an exact-value box
    beside it (up to ``box_max``)."""
    slider = widgets.FloatLogSlider(
        value=float(min(value, slider_max)),
        base=2,
        min=0,
        max=math.log2(slider_max),
        step=0.25,
        description=description,
        continuous_update=continuous,
        readout=False,
    )
    box = widgets.BoundedIntText(value=value, min=1, max=box_max, layout={"width": "110px"})
    return slider, box


_SETTINGS: tuple[str, ...] = (
    "batch_size",
    "seq_len",
    "precision",
    "optimizer",
    "optimizer_in_backward",
    "set_to_none",
    "mode",
    "new_tokens",
    "gpu",
    "custom_gib",
    "depth",
    "show_frontier",
    "checkpoint",
    "trainable",
    "grad_accumulation",
    "lora_rank",
    "expandable_segments",
    "gpus",
    "strategy",
    "gpus_per_node",
)


def show_memory(
    model: Any,
    input_size: Any = None,
    inputs: Any = None,
    loss_fn: Any = None,
    device: str = "cuda",
    seq_axis: Any = None,
    cache: Any = True,
    recipe: Recipe | None = None,
    trust_remote_code: bool = False,
    **initial_settings: Any,
) -> MemoryWidget:
    """Profile ``model`` once and show an interactive memory / FLOPs widget.

    Parameters
    ----------
    model : torch.nn.Module or str
        The model to estimate (any device, including meta), or a Hugging Face Hub id or a
        local directory holding a config.json (see :func:`vram_widget.profile_model`: built
        from the config alone, profiled at the ``seq_len`` setting, by default 128 tokens).
    input_size : tuple of int, optional
        The shape of one sample (no batch dimension).
    inputs : Tensor, tuple or dict of Tensors, optional
        An example batch (dim 0 is the batch); give this or ``input_size``.
    loss_fn : callable, optional
        Maps the model's output to a scalar loss (see :func:`vram_widget.profile_model`).
    device : {"cuda", "cpu"}
        Whose kernels the estimate is for.
    seq_axis : None, False, int or dict, optional
        The sequence dimension the "sequence length" slider varies (see
        :func:`vram_widget.profile_model`; None finds Hugging Face token inputs).
    cache : bool or path, optional
        Whether the profile is read from and written to the on-disk cache (see
        :func:`vram_widget.profile_model`).
    recipe : Recipe, optional
        A whole setup (:class:`~vram_widget.Recipe`, e.g. from
        ``Recipe.from_training_arguments``): its settings start the controls, those with no
        control (``lora_targets``, ``lora_dtype``, ``context_bytes``, ``lazy_loading``,
        ``fsdp_units``) are held for every estimate, and what its config sets but the
        estimate leaves out is listed in the summary. A setting given here too must agree.
    trust_remote_code : bool, optional
        For a model named by a string whose architecture is the repository's own code: True
        downloads and runs that code (see :func:`vram_widget.profile_model`).
    **initial_settings
        Starting values of the controls: ``batch_size`` (int >= 1), ``seq_len`` (tokens
        per sample, where the profile has a sequence axis; default: the example's),
        ``precision``
        ({"fp32", "bf16", "fp16", "amp-bf16", "amp-fp16"}), ``optimizer`` (a name of
        ``optimizer_names()``, an implementation suffix included: ``"adamw-fused"``; or
        ``"none"``/None), ``optimizer_in_backward`` (bool: each parameter stepped in the
        backward; one GPU, one micro-batch), ``set_to_none`` (bool: False keeps the
        gradients between steps, ``zero_grad(set_to_none=False)``), ``mode``
        ({"train", "inference", "generate"}: generation
        where the model has ``generate()``, the sequence slider then the prompt's length),
        ``new_tokens`` (int >= 1, the tokens a generation adds after the prompt), ``gpu``
        (a GPU name of the catalog, ``"H100"``, ``"custom"``, or a capacity in any form
        ``MemoryEstimate.fits`` takes: ``"80GiB"``, ``"80G"``, ``"24 GB"`` (10**9) or bytes,
        which selects the custom size), ``custom_gib`` (float), ``depth``
        (module grouping depth, int >= 0), ``show_frontier`` (bool: open the batch x
        sequence-length panel, where the profile has a sequence axis), the memory levers
        ``checkpoint`` ("off", "auto" or a class name), ``trainable`` (comma-separated
        parameter-name patterns, "" for all), ``grad_accumulation`` (int >= 1) and
        ``lora_rank`` (0 for none), ``expandable_segments`` (bool, CUDA profiles), and the
        data-parallel ``gpus`` (int >= 1), ``strategy`` ({"ddp", "zero1", "zero2", "zero3",
        "hsdp"}) and ``gpus_per_node`` (int >= 1: hsdp shards within a node; its box shows
        with that strategy).

    Returns
    -------
    MemoryWidget
        The widget (an ``ipywidgets.VBox``; its traits are the settings, ``.estimate`` the
        current :class:`~vram_widget.MemoryEstimate`, ``.figure`` the ``go.FigureWidget``).

    Raises
    ------
    TypeError
        For a setting name that is not one of the controls (before profiling), and for
        inputs :func:`vram_widget.profile_model` refuses with a TypeError, and for an
        ``optimizer_in_backward`` or ``set_to_none`` that is not a bool (before profiling).
    ValueError
        For a ``gpu`` in no capacity form, or an unknown or ambiguous GPU name (before
        profiling; every form ``MemoryEstimate.fits`` takes is valid), for a setting
        value the control refuses (``batch_size=0``), for an unknown optimizer or a
        refused way of stepping it (in the backward with ``set_to_none=False``, with
        ``grad_accumulation`` > 1 or with ``gpus`` > 1; before profiling), and for inputs
        :func:`vram_widget.profile_model` refuses (a sequence past the model's position
        table, no example input); each message names the problem and the valid forms.
    ProfilingError
        Where the model cannot be run on fake tensors or in the CPU fallback, as
        :func:`vram_widget.profile_model` raises it.

    Examples
    --------
    >>> from vram_widget import show_memory, zoo
    >>> w = show_memory(zoo.mlp(), input_size=(784,), device="cpu", batch_size=64)
    >>> w.batch_size = 128          # what the slider does
    >>> w.estimate.batch_size
    128
    >>> w.figure.data[0].name
    'resident'
    >>> show_memory(zoo.mlp(), input_size=(784,), gpu="A100")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: GPU 'A100' is ambiguous: it names 'A100 80GB' (80 GiB), 'A100 40GB' (40 GiB); ...
    >>> w = show_memory(zoo.mlp(), input_size=(784,), device="cpu", optimizer="adamw-fused",
    ...                 optimizer_in_backward=True)
    >>> w.estimate.optimizer_implementation, w.estimate.levers.in_backward
    ('fused', 'adamw-fused')
    """
    from .._profiling.profiler import profile_model

    from_recipe = recipe_settings(recipe) if recipe is not None else None
    if from_recipe is not None:
        for name, value in from_recipe.controls.items():
            if name in initial_settings and initial_settings[name] != value:
                raise ValueError(
                    f"{name}={initial_settings[name]!r} conflicts with the recipe's "
                    f"{value!r}: give the setting in one place"
                )
        initial_settings = {**from_recipe.controls, **initial_settings}
    # settings that need no profile are checked before the model is run
    for name in initial_settings:
        if name not in _SETTINGS:
            raise TypeError(f"unknown setting {name!r}; valid settings are {', '.join(_SETTINGS)}")
    if "gpu" in initial_settings:
        _gpu_settings(initial_settings["gpu"])
    _check_optimizer_settings(initial_settings)
    profile = profile_model(
        model,
        input_size=input_size,
        inputs=inputs,
        loss_fn=loss_fn,
        device=device,
        seq_axis=seq_axis,
        precisions=(initial_settings.get("precision", "fp32"),),  # the first one asked
        cache=cache,
        **_named_model_keywords(model, initial_settings, trust_remote_code),
    )
    try:
        if from_recipe is None:
            return MemoryWidget(profile, **initial_settings)
        return MemoryWidget(
            profile,
            fixed_settings=from_recipe.fixed,
            ignored=from_recipe.ignored,
            **initial_settings,
        )
    except traitlets.TraitError as exc:  # a control's own check of its starting value
        raise ValueError(f"invalid setting: {exc}") from None


def _named_model_keywords(
    model: Any, settings: dict[str, Any], trust_remote_code: bool
) -> dict[str, Any]:
    """profile_model's keywords for a model named by a string: the sequence slider's start
    is the example's length (a module takes neither keyword)."""
    if not isinstance(model, str | os.PathLike):
        return {"trust_remote_code": True} if trust_remote_code else {}
    keywords: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if isinstance(settings.get("seq_len"), int):
        keywords["seq_len"] = settings["seq_len"]
    return keywords


def _check_optimizer_settings(settings: dict[str, Any]) -> None:
    """The optimizer's settings, checked before the model is run: its name, how it steps
    (``optimizer_in_backward``, ``set_to_none``), and what stepping in the backward cannot
    go with in training (micro-batches, several GPUs); each error names the valid forms."""
    try:
        name = _OptimizerTrait("adam").validate(None, settings.get("optimizer", "adam"))
    except traitlets.TraitError as exc:
        raise ValueError(f"invalid setting: {exc}") from None
    in_backward = settings.get("optimizer_in_backward", False)
    set_to_none = settings.get("set_to_none", True)
    record = dataclasses.replace(
        Optimizer.parse(None if name == _NO_OPTIMIZER else name),
        in_backward=in_backward,
        set_to_none=set_to_none,
    )  # a flag that is not a bool, or in backward with set_to_none=False: refused here
    if settings.get("mode", Mode.TRAIN.value) != Mode.TRAIN.value or (
        set_to_none and not in_backward
    ):
        return
    accumulation = settings.get("grad_accumulation", 1)
    parallel = resolve_parallel(
        settings.get("gpus", 1),
        settings.get("strategy", "ddp"),
        gpus_per_node=settings.get("gpus_per_node", DEFAULT_GPUS_PER_NODE),
    )
    if isinstance(accumulation, int):  # else the control's own check says why
        stepping_levers(Levers(grad_accumulation=accumulation), record, None, parallel)


def _gpu_settings(value: Any) -> dict[str, Any]:
    """The ``gpu`` (and ``custom_gib``) traits for a ``gpu=`` setting in any capacity form."""
    if value == CUSTOM_GPU:
        return {"gpu": CUSTOM_GPU}
    target = resolve_gpu(value)
    if target.name in GPUS:
        return {"gpu": target.name}
    return {"gpu": CUSTOM_GPU, "custom_gib": target.memory_bytes / 2**30}
