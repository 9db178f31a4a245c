"""The notebook widget: controls are traits; one observer -> estimate -> figure, in place.

What a person reads first is the answer (:mod:`.widget_text`): a headline strip with the
verdict on the chosen card, the number that decides it, the largest batch (and the longest
sequence), the step's FLOPs and tokens; under it a bar of what fills the peak, the controls
grouped by question (:mod:`.widget_controls`), the waterfall, and the details in collapsed
sections. A move recomputes from the cached :class:`~vram_widget.ModelProfile` (numpy only)
and writes into the same figure in one update; what searches or replays the allocator under
caps (the device figure, a new setting's largest batch, the longest sequence, the GPUs needed)
waits until the controls rest, the headline showing "…" until it lands. Only the first use of
a precision (or an optimizer) not yet profiled runs the profiler once more, behind a
"profiling…" label. No torch at import time: :func:`~.show.show_memory` imports the profiler
when it is called.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import html
import math
import re
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets
import numpy as np
import plotly.graph_objects as go
import traitlets

from .._estimating.estimator import MemoryEstimate
from .._estimating.gpus import CUSTOM_GPU, GPUS, MIN_CAPACITY_BYTES, Gpu, custom_gpu
from .._estimating.options import Device, Mode, Precision
from .._estimating.sharding import (
    DEFAULT_GPUS_PER_NODE,
    SINGLE_DEVICE,
    STRATEGIES,
    resolve_parallel,
)
from .._estimating.tradeoff import Frontier
from .figures import (
    build_figure,
    build_frontier_figure,
    update_figure,
    update_frontier_figure,
)
from .optimizer_control import NO_OPTIMIZER
from .plotly_widget import FigureWidget
from .widget_compile import COMPILE_OFF, CompileMixin, CompileTrait
from .widget_controls import (
    CHECKPOINT_OFF,
    GPUS_MAX,
    OFFLOAD_OFF,
    TP_CHOICES,
    ControlsMixin,
)
from .widget_kv_cache import KVBitsTrait, KVCacheMixin, KVCacheTrait
from .widget_levers import LeversMixin
from .widget_parallel import RanksMixin
from .widget_pipeline import PP_CHOICES, PP_SCHEDULES, PipelineMixin
from .widget_settings import OffloadTrait as _OffloadTrait
from .widget_settings import OptimizerTrait as _OptimizerTrait
from .widget_settings import gpu_settings as _gpu_settings
from .widget_settings import offload_arg, weights_arg
from .widget_summary import DETAILS_TITLE, SummaryMixin
from .widget_text import (
    Headline,
    format_bytes,
    format_seconds,
    rows_html,
)
from .widget_weights import Float8Trait, WeightsMixin, WeightsTrait

if TYPE_CHECKING:
    import pandas as pd

    from .._estimating.profile import ModelProfile

__all__ = ["SETTINGS", "MemoryWidget", "format_bytes"]

BATCH_MAX = 2**40
"""The largest batch the widget accepts (the exact box's bound and ``max_batch_size``'s limit)."""
# new tokens a generation starts with (less where the model's positions run out first)
DEFAULT_NEW_TOKENS = 128
_NO_OPTIMIZER = NO_OPTIMIZER
_CHECKPOINT_OFF = CHECKPOINT_OFF


class MemoryWidget(
    ControlsMixin,
    SummaryMixin,
    LeversMixin,
    CompileMixin,
    PipelineMixin,
    RanksMixin,
    WeightsMixin,
    KVCacheMixin,
    widgets.VBox,
):
    """Interactive memory / FLOPs view of one profiled model (see :func:`~.show.show_memory`).

    Every control is a trait: setting ``w.batch_size = 64`` does what the slider does. The
    current estimate is ``w.estimate``, the figure ``w.figure`` (a ``go.FigureWidget``), the
    headline's numbers ``w.headline`` (a :class:`~.widget_text.Headline`).
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
    # the KV cache generate keeps: None (the model's own) or "quantized" (transformers'
    # QuantizedCache, optimum-quanto backend) at kv_bits 4 or 2 (widget_kv_cache)
    kv_cache = KVCacheTrait(None, allow_none=True)
    kv_bits = KVBitsTrait()
    gpu = traitlets.Enum([*GPUS, CUSTOM_GPU], default_value="H100 SXM 80GB")
    custom_gib = traitlets.Float(24.0)
    depth = traitlets.Int(1, min=0)
    # the batch x sequence-length frontier panel is open (where the profile has a sequence
    # axis): its figure is computed while open, and first opening it may profile lengths
    show_frontier = traitlets.Bool(False)
    # the Linear weights stored by bitsandbytes: None (the precision's dtype), "nf4",
    # "nf4-dq" (double quantization) or "fp4", computed in the precision's dtype, or "int8"
    # (LLM.int8 at threshold 0); torchao's "int8-torchao" / "int4-torchao" / "nf4-torchao"
    weights = WeightsTrait(None, allow_none=True)
    # torchao's float8 training of the Linear layers: None, "tensorwise" or "rowwise"
    # (estimate's float8=; True is "tensorwise"); setting one of the pair clears the other
    float8 = Float8Trait(None, allow_none=True)
    # torch.compile of the training step: "off", "model" or "blocks" (estimate's None / False,
    # True / "model", "blocks"), and the partitioner's activation_memory_budget in [0, 1]
    # (1.0, its default, is estimate's None); the step is eager outside training
    compile = CompileTrait(COMPILE_OFF)
    activation_memory_budget = traitlets.Float(1.0)
    # memory levers: "off", "auto" or a class name of repeated blocks; glob patterns of the
    # parameters that train, comma-separated ("" = as the model is); micro-batches per step
    checkpoint = traitlets.Unicode(_CHECKPOINT_OFF)
    # how the checkpointed blocks are recomputed: "off" (no checkpointing, as checkpoint
    # "off"), "full", "op" (torchtitan's op-level policy) or k (every k-th block); a policy
    # with checkpoint "off" checkpoints the "auto" blocks, as estimate() does, and the
    # checkpoint trait says so (the two move together: off with off)
    checkpoint_policy = traitlets.Union(
        [traitlets.Unicode(), traitlets.Int()], default_value=_CHECKPOINT_OFF
    )
    trainable = traitlets.Unicode("")
    grad_accumulation = traitlets.Int(1, min=1)
    # LoRA adapters of this rank on PEFT's default targets (0: none)
    lora_rank = traitlets.Int(0, min=0)
    # the output projection and cross-entropy over this many chunks of the sequence
    # (torchtune's CEWithChunkedOutputLoss); None: the model's own output and loss
    loss_chunks = traitlets.Int(None, allow_none=True)
    # the forward's saved activations offloaded to host memory: "off", "torchtune"
    # (torchtune's OffloadActivations) or "save_on_cpu" (torch.autograd.graph.save_on_cpu);
    # estimate's True, None and False are read as "torchtune", "off" and "off"
    offload_activations = _OffloadTrait(OFFLOAD_OFF)
    # the caching allocator replayed with expandable_segments:True (CUDA estimates)
    expandable_segments = traitlets.Bool(False)
    # data parallelism: ranks (1: one device) and how they share the step (sharding)
    gpus = traitlets.Int(1, min=1, max=GPUS_MAX)
    strategy = traitlets.Enum([s.value for s in STRATEGIES], default_value="ddp")
    # GPUs in one node: hsdp shards within a node and replicates across nodes (its control
    # shows with that strategy)
    gpus_per_node = traitlets.Int(DEFAULT_GPUS_PER_NODE, min=1, max=GPUS_MAX)
    # tensor-parallel ranks among gpus (1: none), sharded by the model's own plan; each new
    # question with tp > 1 is one rank's profiling run (tensor_parallel.py)
    tp = traitlets.Enum(list(TP_CHOICES), default_value=1)
    # pipeline stages (1: none), one a GPU: moving pp sets gpus to dp x pp x tp, dp kept
    # under zero2 / zero3 and 1 under the others (widget_pipeline);
    # the schedule, and the micro-batches the batch is split into (None: pp); each new
    # question with pp > 1 profiles every stage
    pp = traitlets.Enum(list(PP_CHOICES), default_value=1)
    pp_schedule = traitlets.Enum(list(PP_SCHEDULES), default_value="gpipe")
    microbatches = traitlets.Int(None, allow_none=True, min=1)
    # the stages a pipeline rank holds with "interleaved-1f1b" (None: 2, torchtitan's default)
    stages_per_rank = traitlets.Int(None, allow_none=True, min=1)
    # expert-parallel ranks (1: none) of a model with experts, and context-parallel ranks
    # (1: none), each holding seq_len / cp tokens: the whole world, so moving either sets
    # gpus to it (widget_parallel); each new question with ep or cp > 1 profiles one rank
    ep = traitlets.Int(1, min=1)
    cp = traitlets.Int(1, min=1)

    # set in __init__; declared here for the mixins (widget_controls, widget_summary), whose
    # methods take a MemoryWidget as self
    _estimate: MemoryEstimate
    # set while a moved setting's partner is being set (no second estimate)
    _pairing: bool
    # set while the controls show the traits (no feedback into them)
    _syncing: bool
    _headline: widgets.HTML
    _bar: widgets.HTML
    _details: widgets.HTML
    _details_panel: widgets.Accordion
    _table: widgets.HTML
    _frontier_panel: widgets.Accordion

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
        # set while the checkpoint / policy pair's partner is being set (no second estimate)
        self._pairing = False
        self._fit_cache: dict[tuple[Any, ...], int] = {}
        self._per_sample_cache: dict[tuple[Any, ...], int] = {}
        self._frontier_cache: dict[tuple[Any, ...], Frontier] = {}
        self._seq_cache: dict[tuple[Any, ...], int | None] = {}
        self._gpus_cache: dict[tuple[Any, ...], int | None] = {}
        self._pipeline_answered = set()
        self._ranks_answered = set()
        self._at_rest_pending: asyncio.TimerHandle | None = None
        # why the last setting could not be estimated (shown in the headline until a move)
        self._error = ""
        self._device_text = ""
        self._parallel_text = ""
        self._headline_numbers: Headline | None = None
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
        if any(settings.get(n, 1) != 1 for n in ("pp", "ep", "cp")) and "gpus" not in settings:
            # the world size, as moving the pp, ep or cp control sets it (widget_pipeline,
            # widget_parallel)
            world = math.prod(settings.get(n, 1) for n in ("pp", "tp", "ep", "cp"))
            settings = {**settings, "gpus": world}
        if "gpu" in settings:
            # any form a capacity takes: a catalog name, "80GiB", bytes (custom size)
            settings = {**settings, **_gpu_settings(settings["gpu"])}
        # Apply settings before any control exists, so a bad value raises TraitError here.
        with self.hold_trait_notifications():
            for name, value in settings.items():
                if not self.has_trait(name) or name not in SETTINGS:
                    raise TypeError(
                        f"unknown setting {name!r}; valid settings are {', '.join(SETTINGS)}"
                    )
                setattr(self, name, value)
            self._pair_checkpoint(None)
        self._estimate = self._compute()
        self._pipeline_answered_now()
        self._ranks_answered_now()
        figure = build_figure(
            self._estimate,
            depth=self.depth,
            capacity_bytes=self.target.memory_bytes,
            gpu_name=self.target.name,
        )
        figure.update_layout(autosize=True)  # as wide as the notebook; its height is kept
        self._figure = FigureWidget(figure)
        self._build_controls()
        self._headline = widgets.HTML(layout={"width": "100%"})
        # profiling runs: what runs, and how long it took
        self._status = widgets.HTML()
        self._bar = widgets.HTML(layout={"width": "100%"})
        self._details = widgets.HTML()
        self._details_panel = widgets.Accordion(
            children=[self._details], titles=(DETAILS_TITLE,), selected_index=None
        )
        self._table = widgets.HTML()
        self._csv_button = widgets.Button(
            description="Download CSV",
            icon="download",
            tooltip="the per-layer table of the current setting (w.to_csv())",
        )
        self._csv_button.on_click(self._show_csv_link)
        self._csv_link = widgets.HTML()
        # the opening setting's loaded layout (the details' "Loaded"), before any move; where
        # it cannot be had, the details row says why
        with contextlib.suppress(ValueError, TypeError, ImportError):
            profile.load_bytes(
                precision=self.precision, weights=weights_arg(self.weights, self.precision)
            )
        self._render_text()
        panels = [
            self._details_panel,
            widgets.Accordion(
                children=[
                    widgets.VBox([widgets.HBox([self._csv_button, self._csv_link]), self._table])
                ],
                titles=("Layers (largest first)",),
                selected_index=None,
            ),
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
            panels.insert(1, self._frontier_panel)
        self.layout.width = "100%"
        self.children = [
            self._headline,
            self._status,
            self._bar,
            self._controls,
            self._figure,
            *panels,
        ]
        self.observe(self._on_change, names=list(SETTINGS))
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
    def headline(self) -> Headline:
        """The headline's numbers as shown (None where a search has not landed yet)."""
        assert self._headline_numbers is not None
        return self._headline_numbers

    @property
    def headline_html(self) -> str:
        """The headline strip's HTML: the verdict, the deciding number, the largest batch
        (and longest sequence), FLOPs and tokens; and why a setting was refused."""
        return str(self._headline.value)

    @property
    def details_html(self) -> str:
        """The details' HTML (a table of labelled rows; in a kernel the view fills them once
        the controls rest, and reading them fills them now)."""
        self._rest_now()
        return str(self._details.value)

    @property
    def summary_html(self) -> str:
        """Everything the widget says in words: the headline, the bar of what fills the
        peak, and the details (the current setting's: what waits for the controls' rest is
        filled now)."""
        self._rest_now()
        return f"{self._headline.value}{self._bar.value}{self._details.value}"

    @property
    def device_html(self) -> str:
        """The device row's HTML (CUDA): allocated -> reserved -> what the device needs;
        filled now where the controls' rest is pending (empty on CPU)."""
        self._rest_now()
        return self._device_text

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
            **self._compile_settings(),
            "loss_chunks": self.loss_chunks,
            "offload_activations": offload_arg(self.offload_activations),
            **self._weights_settings(),
            **({"expandable_segments": self.expandable_segments} if self._cuda else {}),
            "gpus": self.gpus,
            "strategy": self.strategy,
            "gpus_per_node": self.gpus_per_node,
            "tp": self.tp,
            **self._pipeline_settings(),
            **self._rank_settings(),
            **self._fixed,
            **self._kv_cache_settings(),
        }

    @property
    def _generating(self) -> bool:
        return self.mode == Mode.GENERATE.value

    @property
    def _cuda(self) -> bool:
        return self._profile.device is Device.CUDA

    def _needs_profiling(self) -> bool:
        """Whether the current precision / optimizer (or, with the frontier open, the fit
        in the length) still has to be profiled (torch)."""
        if self._pipeline_parallel:  # each new question runs every stage
            return self._pipeline_needs_profiling()
        if self._rank_parallel:  # each new question is one ep or cp rank's sub-profile
            return self._ranks_need_profiling()
        if self._tensor_parallel:  # each new question is a sub-profile of its own
            return not self._profile.tensor_parallel_cached(self.batch_size, **self._settings())
        levers = self._step_levers()
        if levers is None:  # refused by the estimate at once, nothing profiled
            return False
        quantized_cache = self._kv_cache_needs_profiling()
        if quantized_cache is not None:  # the quantized KV cache: a sub-profile answers
            return quantized_cache
        weighted = self._weights_needs_profiling()
        if weighted is not None:  # quantized weights or float8: a sub-profile answers
            return weighted
        try:  # FSDP2 under autocast steps on half parameters: a profiling run of its own
            parallel = resolve_parallel(self.gpus, self.strategy, gpus_per_node=self.gpus_per_node)
        except ValueError:  # the estimate says why
            parallel = SINGLE_DEVICE
        cached = self._profile.is_cached(
            self.precision, self.mode, self._settings()["optimizer"], self.seq_len, levers,
            parallel, self._settings()["new_tokens"],
            # the compiled step is profiled at each batch (compiled.decided_at)
            batch_size=self.batch_size if self._compiled else None,
        )  # fmt: skip
        if cached and self.mode == Mode.TRAIN.value and levers.active:
            # the summary compares with the same step without levers
            optimizer = self._settings()["optimizer"]
            cached = self._profile.is_cached(self.precision, self.mode, optimizer, self.seq_len)
        if self._frontier_shown() and self._frontier_key() not in self._frontier_cache:
            cached = cached and self._profile.length_fit_tried(self.precision, self.mode, levers)
        return not cached

    def _frontier_shown(self) -> bool:
        # not with compile or tp > 1: the frontier would profile a step at each batch it tries
        return self.show_frontier and self._profile.has_seq_axis and not self._per_batch

    @property
    def _tensor_parallel(self) -> bool:
        """Whether the estimate is one of tp > 1 tensor-parallel ranks': each batch and
        setting is a profiling run of its own, so the searches over them are not run."""
        return self.tp > 1

    @property
    def _per_batch(self) -> bool:
        """Whether each batch is a profiling run of its own: the compiled step (compiled.
        decided_at), a tensor-, expert- or context-parallel rank's sub-profile and the
        pipeline stages' steps, whose keys hold the batch."""
        layouts = (self._tensor_parallel, self._pipeline_parallel, self._rank_parallel)
        return self._compiled or any(layouts)

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
        # a library not installed, said before profiling
        refusal = self._weights_refusal() or self._kv_cache_refusal()
        if refusal:
            raise ValueError(refusal)
        return self._profile.estimate(self.batch_size, **self._settings())

    def _on_change(self, change: dict[str, Any]) -> None:
        """The one observer: any setting -> estimate -> figure, headline and bar, in place.

        Where the setting needs a profiling run (torch, seconds), the status says so and the
        controls are disabled *before* it starts, and both are restored after it; on failure
        the setting goes back to its last value (traits stay the truth of what is shown) and
        the headline says why. A move of the checkpoint or its policy moves its partner
        first (:func:`~.widget_settings.paired_checkpoint`), and one estimate shows both.
        """
        if self._pairing:
            return
        checkpoint_partner = self._pair_checkpoint(change["name"])
        partners = [
            *([] if checkpoint_partner is None else [checkpoint_partner]),
            *self._pair_pipeline(change["name"], change.get("old")),
            *self._pair_world(change["name"]),
            *filter(None, [self._pair_weights(change["name"])]),
        ]
        # The batch and the grouping depth are in no profile's or frontier's key: a move of
        # either never profiles (the slider's common case skips the checks, ~0.3 ms), but
        # for the compiled step and a tensor-parallel rank, profiled at each batch
        unprofiled = change["name"] in _NEVER_PROFILES and not (
            change["name"] == "batch_size" and self._per_batch
        )
        profiling = not unprofiled and self._needs_profiling()
        # the frontier of a new setting is a search with allocator replays at each length:
        # a second or two, so it gets the same label and disabled controls
        frontier_pending = (
            not unprofiled
            and self._frontier_shown()
            and self._frontier_key() not in self._frontier_cache
        )
        started = 0.0
        if profiling or frontier_pending:
            doing = "profiling" if profiling else "computing the batch x length frontier for"
            self._status.value = f"<i>⏳ {doing} {self._what()} (first use, runs once)…</i>"
            self._set_busy(True)
            started = time.perf_counter()
        try:
            est = self._compute()
            frontier = self.frontier() if self._frontier_shown() else None
        except Exception as exc:  # a failed extra profiling run: say so, keep the last view
            what = self._what()
            self._set_busy(False)
            self._revert(change, partners)
            why = (
                f"could not {'profile' if profiling else 'estimate'} {what}: "
                f"{type(exc).__name__}: {exc}; kept {change['name']} = {change['old']!r}"
            )
            self._status.value = f"<span style='color:#b00'>{html.escape(why)}</span>"
            self._error = why
            self._render_headline(at_rest=self._at_rest_pending is None)
            return
        self._error = ""
        self._pipeline_answered_now()
        self._ranks_answered_now()
        if profiling and change["name"] in ("weights", "float8"):
            # the loaded layout of the new weights, beside their sub-profile (a meta build)
            with contextlib.suppress(ValueError, TypeError, ImportError):
                self._profile.load_bytes(
                    precision=self.precision, weights=weights_arg(self.weights, self.precision)
                )
        if profiling or frontier_pending:
            self._set_busy(False)
            elapsed = format_seconds(time.perf_counter() - started)
            done = "profiled" if profiling else "computed the frontier for"
            self._status.value = f"<i>{done} {self._what()} in {elapsed}</i>"
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

    def _what(self) -> str:
        """The setting in a few words, for the status line (HTML-escaped)."""
        levers = self._step_levers()
        return html.escape(
            f"{self.precision} / {self.mode}"
            + (f" / {self.optimizer}" if self.mode == Mode.TRAIN.value else "")
            + (f" / {self.seq_len} tokens" if self.seq_len is not None else "")
            + (f" + {self.new_tokens} new" if self._generating else "")
            + (f" / KV cache {self.kv_cache} {self.kv_bits}-bit" if self._kv_cache_active else "")
            + (f" / {levers.describe()}" if levers is not None and levers.active else "")
            + (f" / tp={self.tp}" if self._tensor_parallel else "")
            + "".join(f" / {k}={v}" for k, v in self._rank_settings().items())
            + (
                f" / {self._stage_ranks_text()}pp={self.pp} {self.pp_schedule} x "
                f"{self.microbatches or self.pp}"
                if self._pipeline_parallel
                else ""
            )
        )

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

    def _revert(self, change: dict[str, Any], partners: Sequence[tuple[str, Any]] = ()) -> None:
        """Put a setting whose estimate failed back to its last value (re-renders that),
        and the partners it moved (the checkpoint / policy pair; pp's GPUs and
        micro-batches) first."""
        name = change.get("name")
        if self._reverting or name not in SETTINGS or "old" not in change:
            return  # never bounce between two settings that both fail
        self._reverting = True
        try:
            for partner in partners:
                self._pairing = True
                try:
                    setattr(self, *partner)
                finally:
                    self._pairing = False
            setattr(self, name, change["old"])
        finally:
            self._reverting = False

    # ------------------------------------------------------------------ static fallback

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        """The widget view where widgets run, plus a static figure and summary as HTML for
        front ends that cannot run widgets (nbviewer, GitHub, exported notebooks)."""
        bundle: dict[str, Any] = dict(super()._repr_mimebundle_(**kwargs) or {})
        bundle["text/html"] = self.static_html()
        return bundle

    def static_html(self) -> str:
        """The headline, the bar, the figure (plotly.js from the CDN) and the details as one
        HTML fragment (the details as at rest)."""
        est = self._estimate
        self._rest_now()
        fig = go.Figure(self._figure)
        return (
            f"<div>{self._headline.value}</div><div>{self._bar.value}</div>"
            + fig.to_html(include_plotlyjs="cdn", full_html=False)
            + f"<div>{rows_html(self._detail_rows(est))}</div>"
        )


# settings that are in no profile's cache key nor the frontier's (_settings leaves them out)
_NEVER_PROFILES = ("batch_size", "depth")


SETTINGS: tuple[str, ...] = (
    "batch_size",
    "seq_len",
    "precision",
    "optimizer",
    "optimizer_in_backward",
    "set_to_none",
    "mode",
    "new_tokens",
    "kv_cache",
    "kv_bits",
    "gpu",
    "custom_gib",
    "depth",
    "show_frontier",
    "checkpoint",
    "checkpoint_policy",
    "trainable",
    "grad_accumulation",
    "lora_rank",
    "loss_chunks",
    "offload_activations",
    "weights",
    "float8",
    "compile",
    "activation_memory_budget",
    "expandable_segments",
    "gpus",
    "strategy",
    "gpus_per_node",
    "tp",
    "pp",
    "pp_schedule",
    "microbatches",
    "stages_per_rank",
    "ep",
    "cp",
)
