"""The widget's controls, grouped by the question each answers.

A tab per question: **Step** (what one step is: batch, sequence length, precision, mode,
``torch.compile`` and its memory budget (:mod:`.widget_compile`), a generation's new
tokens), **Optimizer** (:mod:`.optimizer_control`), **Memory levers** (what trades compute
for memory: checkpointing and its policy, the parameters that train, micro-batches, LoRA,
the chunked output and loss, activation offloading) and **GPUs** (the card, its
allocator's ``expandable_segments`` setting, and the parallel layouts: data, tensor, expert
and context parallelism (:mod:`.widget_parallel`), pipeline stages
(:mod:`.widget_pipeline`)); how the figure groups modules is a display setting, in a small
"Display" section apart from the questions. Every control has a visible label and a
tooltip saying what it changes.

The controls are views of the widget's traits (the truth): a control writes its trait, and
:meth:`ControlsMixin._sync_controls` shows the traits on the controls without feeding back.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets

from .._estimating.checkpoint_policy import CheckpointPolicyName
from .._estimating.gpus import CUSTOM_GPU, GPUS
from .._estimating.options import Device, Mode
from .._estimating.profile_searches import DEFAULT_MAX_SEQ_LEN
from .optimizer_control import OptimizerControls
from .widget_compile import COMPILE_OFF

if TYPE_CHECKING:
    from .widget import MemoryWidget

__all__ = [
    "BATCH_SLIDER_MAX",
    "CHECKPOINT_OFF",
    "EVERY_K",
    "GPUS_MAX",
    "GROUP_TITLES",
    "LOSS_CHUNK_CHOICES",
    "OFFLOAD_CHOICES",
    "OFFLOAD_OFF",
    "POLICY_NAMES",
    "SEQ_SLIDER_MAX",
    "TOOLTIPS",
    "TP_CHOICES",
    "ControlsMixin",
]

BATCH_SLIDER_MAX = 8192
# The sequence slider's top where the model has no learned position table: 128k tokens
SEQ_SLIDER_MAX = DEFAULT_MAX_SEQ_LEN
# the tensor-parallel degrees offered (those up to the GPUs)
TP_CHOICES: tuple[int, ...] = (1, 2, 4, 8)
# the GPUs slider's top (log scale, like the batch's)
GPUS_MAX = 1024
CHECKPOINT_OFF = "off"
# the checkpoint_policy trait's named values: "off" (no checkpointing) and the named policies
# of estimate()'s checkpoint_policy (CheckpointPolicyName); an int k is the other form
POLICY_NAMES: tuple[str, ...] = (CHECKPOINT_OFF, *(p.value for p in CheckpointPolicyName))
# the checkpoint policy dropdown's choice that shows the k box (the trait holds k itself)
EVERY_K = "every k"
# the loss chunks dropdown's counts (torchtune's recipes use 8: num_output_chunks in
# recipes/configs/llama3_2/3B_full_single_device.yaml, torchtune 0.6.1); 0 is "off"
LOSS_CHUNK_CHOICES: tuple[int, ...] = (2, 4, 8, 16)
# the offload_activations trait's values: off, and estimate's two ways of offloading
OFFLOAD_OFF = "off"
OFFLOAD_CHOICES: tuple[str, ...] = (OFFLOAD_OFF, "torchtune", "save_on_cpu")

GROUP_TITLES: tuple[str, ...] = ("Step", "Optimizer", "Memory levers", "GPUs")
"""The control tabs, in order: each answers one question about the step."""

TOOLTIPS: dict[str, str] = {
    "batch_size": "samples per step (per GPU with data parallelism): the slider up to "
    f"{BATCH_SLIDER_MAX:,}, the box any size",
    "seq_len": "tokens per sample (the prompt's length in a generation)",
    "precision": "the dtype of weights and activations: fp32, bf16/fp16 (all half), or "
    "amp-* (fp32 weights, autocast activations)",
    "weights": "the Linear weights stored by bitsandbytes: nf4, nf4 with QLoRA's double "
    "quantization, or fp4 (Linear4bit, computed in the precision's dtype; training needs a "
    "LoRA rank: QLoRA), or int8 (Linear8bitLt, inference, without the outlier split: "
    "threshold 0); int8 / int4 (torchao): torchao's quantize_ (inference; int4 on the CPU "
    "only); nf4 (torchao): torchao's NF4Tensor as torchtune's QLoRA (training needs a LoRA "
    "rank); float8 training (tensorwise / rowwise): torchao's Float8Linear (training on "
    "one GPU; the weights stay in the precision's dtype); model's own: the precision's "
    "dtype. A new choice profiles once (seconds); one the setting refuses is kept back, "
    "the headline saying why",
    "mode": "train: forward, backward, optimizer step; inference: one forward under "
    "no_grad; generate: prefill and decode steps with the KV cache",
    "new_tokens": "tokens a generation adds after the prompt (its KV cache grows with them)",
    "checkpoint": "activation checkpointing (torch.utils.checkpoint, non-reentrant): auto "
    "wraps the repeated blocks, or name a block class; recomputes their forward",
    "checkpoint_policy": "how the checkpointed blocks are recomputed: full (each whole "
    "block), op (torchtitan's op-level selective policy: matmul and attention outputs "
    "saved), every k (every k-th block, torchtitan's selective_ac_option); off: no "
    "checkpointing. With checkpointing off, a policy checkpoints the auto blocks",
    "checkpoint_policy_k": "k of the every-k policy: every k-th block is checkpointed (1: all)",
    "loss_chunks": "the output projection and cross-entropy over this many chunks of the "
    "sequence (torchtune's CEWithChunkedOutputLoss): one chunk of fp32 logits at a time; "
    "off: the model's own output and loss",
    "offload_activations": "the forward's saved activations copied to host memory and back "
    "in the backward: torchtune (torchtune's OffloadActivations: tensors of at least 1 KiB, "
    "pinned, the output projection's kept on the GPU) or save_on_cpu "
    "(torch.autograd.graph.save_on_cpu: every saved tensor); the host memory they take is "
    "in the details; off: kept on the GPU",
    "trainable": "glob patterns of the parameters that train, comma-separated (head.*, "
    "*.bias); empty: as the model is. Frozen parameters keep no gradient or state",
    "grad_accumulation": "micro-batches per optimizer step: each is one batch; gradients "
    "accumulate, one optimizer step at the end",
    "lora_rank": "LoRA adapters of this rank on PEFT's default target modules (0: none); the "
    "base weights freeze",
    "gpu": "the card whose memory the step is compared with",
    "custom_gib": "the card's memory in GiB, used when the GPU is 'custom'",
    "expandable_segments": "replay the caching allocator with PYTORCH_CUDA_ALLOC_CONF="
    "expandable_segments:True (less fragmentation; CUDA profiles)",
    "gpus": "data-parallel ranks: each runs the batch; the estimate is one rank's (with "
    "tp or pp: the world size, dp x pp x tp; with pp > 1 it moves in multiples of pp x tp, "
    "dp > 1 taken with strategy zero2, zero3 or hsdp, FSDP2 over each stage's ranks)",
    "strategy": "how the ranks share the step: ddp replicates all; zero1 shards optimizer "
    "state; zero2/zero3 (FSDP2) shard gradients / parameters too; hsdp shards in a node",
    "gpus_per_node": "GPUs in one node: hsdp shards within a node, replicates across nodes",
    "tp": "tensor-parallel ranks among the GPUs, sharded by the model's own plan "
    "(transformers' base_model_tp_plan); 1: none. Each new batch or setting with tp > 1 "
    "profiles one rank (seconds); the largest-batch searches are not run",
    "depth": "how deep the waterfall and the layers table group modules (0: the whole model)",
}
"""What each control changes (its tooltip), by the trait it sets."""


def log_slider_and_box(
    description: str,
    value: int,
    slider_max: int,
    box_max: int,
    *,
    continuous: bool,
    tooltip: str,
) -> tuple[widgets.FloatLogSlider, widgets.BoundedIntText]:
    """A base-2 log slider from 1 to ``slider_max`` in quarter steps, and an exact-value box
    beside it (up to ``box_max``); both carry ``tooltip``."""
    slider = widgets.FloatLogSlider(
        value=float(min(value, slider_max)),
        base=2,
        min=0,
        max=math.log2(slider_max),
        step=0.25,
        description=description,
        continuous_update=continuous,
        readout=False,
        tooltip=tooltip,
        style={"description_width": "initial"},
    )
    box = widgets.BoundedIntText(
        value=value, min=1, max=box_max, layout={"width": "110px"}, tooltip=tooltip
    )
    return slider, box


def _row(*children: widgets.Widget, **layout: Any) -> widgets.HBox:
    return widgets.HBox(list(children), layout={"flex_flow": "row wrap", **layout})


class ControlsMixin:
    """Builds, groups and syncs the controls of :class:`~.widget.MemoryWidget`."""

    def _build_controls(self: MemoryWidget) -> None:  # type: ignore[misc]
        self._build_sliders()
        self._group_controls(self._build_choices())

    def _build_sliders(self: MemoryWidget) -> None:  # type: ignore[misc]
        """The integer settings' log sliders and exact boxes (batch, length, new tokens,
        GPUs), each pair writing its trait."""
        moved = self._control_moved
        self._batch_slider, self._batch_box = log_slider_and_box(
            "batch size",
            self.batch_size,
            BATCH_SLIDER_MAX,
            2**40,
            continuous=True,
            tooltip=TOOLTIPS["batch_size"],
        )
        # The sequence length, where the profile has a sequence axis: a log slider like the
        # batch's, up to the model's learned positions (else 128k tokens), and a box. A move
        # may profile (the first other length), so the slider reports on release.
        seq_max = self._profile.seq_len_limit or SEQ_SLIDER_MAX
        self._seq_slider, self._seq_box = log_slider_and_box(
            "prompt length" if self._generating else "sequence length",
            self.seq_len or 1,
            seq_max,
            seq_max,
            continuous=False,
            tooltip=TOOLTIPS["seq_len"],
        )
        self._seq_row = _row(
            self._seq_slider,
            self._seq_box,
            display=None if self._profile.has_seq_axis else "none",
        )
        # Generation: the new tokens after the prompt (a log slider and a box, up to the
        # model's positions); the prompt is the sequence slider, relabelled.
        tokens_max = self._profile.generation_limit or SEQ_SLIDER_MAX
        self._tokens_slider, self._tokens_box = log_slider_and_box(
            "new tokens",
            self.new_tokens,
            tokens_max,
            tokens_max,
            continuous=False,
            tooltip=TOOLTIPS["new_tokens"],
        )
        self._generation_row = _row(
            self._tokens_slider,
            self._tokens_box,
            self._build_kv_cache_control(),  # widget_kv_cache
            display=None if self._generating else "none",
        )
        # Data parallelism: the ranks (a log slider like the batch's, and a box)
        self._gpus_slider, self._gpus_box = log_slider_and_box(
            "GPUs", self.gpus, GPUS_MAX, GPUS_MAX, continuous=False, tooltip=TOOLTIPS["gpus"]
        )
        for name, slider, box in (
            ("batch_size", self._batch_slider, self._batch_box),
            ("seq_len", self._seq_slider, self._seq_box),
            ("new_tokens", self._tokens_slider, self._tokens_box),
            ("gpus", self._gpus_slider, self._gpus_box),
        ):
            slider.observe(functools.partial(moved, name), "value")
            box.observe(functools.partial(moved, name), "value")

    def _build_choices(self: MemoryWidget) -> dict[str, widgets.DOMWidget]:  # type: ignore[misc]
        """The other controls, each linked to its trait with a label and a tooltip; the
        optimizer's are :class:`~.optimizer_control.OptimizerControls`."""
        modes = [m.value for m in Mode if m is not Mode.GENERATE or self._profile.generates]
        precision = widgets.Dropdown(
            options=list(self.traits()["precision"].values or []), layout={"width": "200px"}
        )
        # a view of the weights and float8 traits (widget_weights)
        weights = self._build_weights_control()
        # a flex row: ipywidgets' ToggleButtons is a block whose buttons go under its label
        mode = widgets.ToggleButtons(
            options=modes,
            style={"button_width": "90px"},
            layout={"display": "flex", "align_items": "center"},
        )
        self._mode_buttons = mode
        # the optimizer, its implementation, and how it steps (two checkboxes)
        self._optimizer_controls = OptimizerControls(self, self._profile.device)
        # The memory levers: checkpointing ("auto" where the model has repeated blocks, and
        # each class with repeated instances), the parameters that train, accumulation.
        types = self._profile.rows.types[:-2]
        repeated = sorted({t for t in types[1:] if types.count(t) > 1})
        auto = ["auto"] if self._profile.checkpoint_blocks else []
        options = [CHECKPOINT_OFF, *auto, *repeated]
        if self.checkpoint not in options:
            options.append(self.checkpoint)
        self._checkpoint_dropdown = widgets.Dropdown(options=options, layout={"width": "260px"})
        self._build_lever_choices()
        self._build_compile_controls()
        trainable = widgets.Text(
            placeholder="all (or patterns: head.*, *.bias)",
            continuous_update=False,
            layout={"width": "320px"},
        )
        accumulation = widgets.BoundedIntText(min=1, max=1 << 20, layout={"width": "190px"})
        lora = widgets.BoundedIntText(min=0, max=4096, layout={"width": "170px"})
        gpu = widgets.Dropdown(options=[*GPUS, CUSTOM_GPU], layout={"width": "300px"})
        self._custom_box = widgets.BoundedFloatText(
            min=0.001, max=1e6, layout={"width": "170px"}, disabled=self.gpu != CUSTOM_GPU
        )
        expandable = widgets.Checkbox(indent=False, layout={"width": "220px"})
        if self._profile.device is not Device.CUDA:  # no caching allocator to replay
            expandable.layout.display = "none"
        # a view of its trait (as tp's, below): a strategy refused beside tp, ep, cp or pp
        # goes back on the dropdown too
        self._strategy_dropdown = strategy = widgets.Dropdown(
            options=list(self.traits()["strategy"].values or []),
            value=self.strategy,
            description="strategy",
            tooltip=TOOLTIPS["strategy"],
            style={"description_width": "initial"},
            layout={"width": "200px"},
        )
        strategy.observe(lambda change: self._set_from_control("strategy", change["new"]), "value")
        self._per_node_box = widgets.BoundedIntText(min=1, max=GPUS_MAX, layout={"width": "150px"})
        # tp: disabled, the reason in its tooltip, where the model has no plan. A view of
        # its trait, not a link: a tp the estimate refuses with the other layouts (ep, cp,
        # pp) puts the trait back, and the sync puts the dropdown back with it
        self._tp_refusal = self._profile.tensor_parallel_refusal(2)
        self._tp_dropdown = widgets.Dropdown(
            options=self._tp_options(),
            value=self.tp,
            description="tp",
            tooltip=TOOLTIPS["tp"],
            style={"description_width": "initial"},
            layout={"width": "110px"},
            disabled=bool(self._tp_refusal),
        )
        self._tp_dropdown.observe(
            lambda change: self._set_from_control("tp", change["new"]), "value"
        )
        # pp, its schedule, stages a rank and micro-batches (widget_pipeline); ep and cp
        # (widget_parallel)
        self._pipeline_controls = self._build_pipeline_controls()
        self._rank_controls = self._build_rank_controls()
        max_depth = (
            int(self._estimate.layers.depth.max()) if len(self._estimate.layers.depth) else 0
        )
        self._depth_slider = widgets.IntSlider(min=0, max=max(max_depth, 1))
        for control, name, label in (
            (precision, "precision", "precision"),
            (mode, "mode", "mode"),
            (gpu, "gpu", "GPU"),
            (self._custom_box, "custom_gib", "custom GiB"),
            (self._depth_slider, "depth", "group depth"),
            (self._checkpoint_dropdown, "checkpoint", "checkpointing"),
            (trainable, "trainable", "trainable"),
            (accumulation, "grad_accumulation", "micro-batches"),
            (lora, "lora_rank", "LoRA rank"),
            (expandable, "expandable_segments", "expandable_segments"),
            (self._per_node_box, "gpus_per_node", "per node"),
        ):
            control.description = label
            control.tooltip = TOOLTIPS[name]
            # Labels as wide as their text, so no control wraps under its own label.
            control.style.description_width = "initial"
            widgets.link((self, name), (control, "value"))
        weights.description = "weights"
        weights.tooltip = TOOLTIPS["weights"]
        weights.style.description_width = "initial"
        if self._tp_refusal:
            self._tp_dropdown.tooltip = f"not available: {self._tp_refusal}"
        return {
            "precision": precision,
            "weights": weights,
            "mode": mode,
            "gpu": gpu,
            "trainable": trainable,
            "accumulation": accumulation,
            "lora": lora,
            "expandable": expandable,
            "strategy": strategy,
        }

    def _build_lever_choices(self: MemoryWidget) -> None:  # type: ignore[misc]
        """The checkpoint policy (a dropdown, and a k box shown for "every k"), the loss
        chunks (off where the model cannot be chunked, its tooltip saying why) and the
        activation offloading (off on a CPU profile, likewise): views of their traits,
        which a refused value leaves as they were (``_set_from_control``)."""
        style = {"description_width": "initial"}
        self._policy_dropdown = widgets.Dropdown(
            options=[*POLICY_NAMES, EVERY_K],
            description="checkpoint policy",
            tooltip=TOOLTIPS["checkpoint_policy"],
            style=style,
            layout={"width": "230px"},
        )
        self._policy_k_box = widgets.BoundedIntText(
            value=2,
            min=1,
            max=1 << 20,
            description="k",
            tooltip=TOOLTIPS["checkpoint_policy_k"],
            style=style,
            layout={"width": "110px"},
        )
        refusal = self._profile.loss_chunks_refusal
        self._chunks_dropdown = widgets.Dropdown(
            options=[("off", 0), *((str(k), k) for k in LOSS_CHUNK_CHOICES)],
            description="loss chunks",
            tooltip=(
                TOOLTIPS["loss_chunks"]
                if not refusal
                else f"loss chunks: not available for this model: {refusal}"
            ),
            disabled=bool(refusal),
            style=style,
            layout={"width": "170px"},
        )
        self._offload_dropdown = widgets.Dropdown(
            options=list(OFFLOAD_CHOICES),
            description="offload activations",
            tooltip=(
                TOOLTIPS["offload_activations"]
                if self._cuda
                else "offload activations: not available on a CPU profile, whose saved "
                "activations are in host memory already; profile with device='cuda'"
            ),
            disabled=not self._cuda,
            style=style,
            layout={"width": "270px"},
        )
        self._policy_dropdown.observe(self._policy_chosen, "value")
        self._policy_k_box.observe(self._policy_chosen, "value")
        self._chunks_dropdown.observe(
            lambda change: self._set_from_control("loss_chunks", change["new"] or None), "value"
        )
        self._offload_dropdown.observe(
            lambda change: self._set_from_control("offload_activations", change["new"]), "value"
        )
        self._sync_lever_choices()

    def _policy_chosen(self: MemoryWidget, _change: dict[str, Any]) -> None:  # type: ignore[misc]
        """The policy dropdown or its k box moved: the trait is the name, or k."""
        choice = self._policy_dropdown.value
        if choice == EVERY_K:
            self._set_from_control("checkpoint_policy", int(self._policy_k_box.value))
        elif not self._syncing:
            self._set_from_control("checkpoint_policy", choice)
        self._policy_k_box.layout.display = None if choice == EVERY_K else "none"

    def _sync_lever_choices(self: MemoryWidget) -> None:  # type: ignore[misc]
        """Show the policy, the loss chunks and the offloading on their controls (no
        feedback: the caller holds ``_syncing``, or nothing observes yet)."""
        policy = self.checkpoint_policy
        every_k = isinstance(policy, int)
        if every_k:
            self._policy_k_box.value = policy
        self._policy_dropdown.value = EVERY_K if every_k else policy
        self._policy_k_box.layout.display = None if every_k else "none"
        chunks = self.loss_chunks or 0
        if chunks not in dict(self._chunks_dropdown.options).values():
            self._chunks_dropdown.options = sorted(
                {*self._chunks_dropdown.options, (str(chunks), chunks)}, key=lambda o: o[1]
            )
        self._chunks_dropdown.value = chunks
        self._offload_dropdown.value = self.offload_activations

    def _group_controls(self: MemoryWidget, c: dict[str, widgets.DOMWidget]) -> None:  # type: ignore[misc]
        """The controls in one tab per question, and the display settings apart."""
        opt = self._optimizer_controls
        self._control_widgets: tuple[widgets.DOMWidget, ...] = (
            self._batch_slider,
            self._batch_box,
            self._seq_slider,
            self._seq_box,
            c["precision"],
            c["weights"],
            *opt.widgets,
            c["mode"],
            self._compile_dropdown,
            self._budget_dropdown,
            c["gpu"],
            self._custom_box,
            self._depth_slider,
            self._checkpoint_dropdown,
            self._policy_dropdown,
            self._policy_k_box,
            c["trainable"],
            c["accumulation"],
            c["lora"],
            self._chunks_dropdown,
            self._offload_dropdown,
            c["expandable"],
            self._gpus_slider,
            self._gpus_box,
            c["strategy"],
            self._per_node_box,
            self._tp_dropdown,
            *self._rank_controls,
            *self._pipeline_controls,
            self._tokens_slider,
            self._tokens_box,
            self._kv_cache_dropdown,
        )
        step = widgets.VBox(
            [
                _row(self._batch_slider, self._batch_box),
                self._seq_row,
                _row(c["precision"], c["weights"], c["mode"]),
                _row(self._compile_dropdown, self._budget_dropdown),
                self._generation_row,
            ]
        )
        optimizer = widgets.VBox(
            [_row(opt.optimizer, opt.implementation), _row(opt.in_backward, opt.keep_grads)]
        )
        self._levers_row = _row(
            self._checkpoint_dropdown,
            self._policy_dropdown,
            self._policy_k_box,
            c["trainable"],
            c["accumulation"],
            c["lora"],
            self._chunks_dropdown,
            self._offload_dropdown,
        )
        self._parallel_row = _row(
            self._gpus_slider,
            self._gpus_box,
            c["strategy"],
            self._per_node_box,
            self._tp_dropdown,
            *self._rank_controls,
            *self._pipeline_controls,
        )
        gpus = widgets.VBox([_row(c["gpu"], self._custom_box, c["expandable"]), self._parallel_row])
        # No width: a box's children stretch across it; "100%" plus each widget's margin
        # drew the tabs past the output's right edge.
        self._tabs = widgets.Tab(
            children=[step, optimizer, widgets.VBox([self._levers_row]), gpus],
            titles=GROUP_TITLES,
        )
        self._display_menu = widgets.Accordion(
            children=[widgets.VBox([self._depth_slider])],
            titles=("Display",),
            selected_index=None,
        )
        self._controls = widgets.VBox([self._tabs, self._display_menu])

    @property
    def control_groups(self: MemoryWidget) -> dict[str, tuple[widgets.DOMWidget, ...]]:  # type: ignore[misc]
        """Each tab's title and the controls in it (sliders, boxes, dropdowns,
        checkboxes), in the order shown; and "Display" for the display settings."""
        groups: dict[str, tuple[widgets.DOMWidget, ...]] = {}
        kinds = tuple(type(c) for c in self._control_widgets)
        for title, child in [
            *zip(GROUP_TITLES, self._tabs.children, strict=True),
            ("Display", self._display_menu.children[0]),
        ]:
            groups[title] = tuple(_controls_in(child, kinds))
        return groups

    def _tp_options(self: MemoryWidget) -> list[int]:  # type: ignore[misc]
        """The tensor-parallel degrees up to the GPUs (and the current one)."""
        return [k for k in TP_CHOICES if k <= self.gpus or k == self.tp]

    def _control_moved(self: MemoryWidget, name: str, change: dict[str, Any]) -> None:  # type: ignore[misc]
        """A slider or box of an integer setting moved: set the trait (never feeding back
        while the controls are synced to the traits). With ``pp > 1`` the GPUs go to the
        next multiple of the world size ``pp x tp`` in the direction moved (``dp x pp x
        tp``; the estimate says which strategies take ``dp > 1``)."""
        if self._syncing or getattr(self, name) is None:
            return
        value = max(1, round(change["new"]))
        if name == "gpus" and self.pp > 1:
            value = self._gpus_step(change["new"])
            if value == self.gpus:  # no move: the controls show the trait again
                self._show_quietly(self._gpus_slider, float(value))
                self._show_quietly(self._gpus_box, value)
                return
        setattr(self, name, value)

    def _set_busy(self: MemoryWidget, busy: bool) -> None:  # type: ignore[misc]
        """Disable every control while a profiling run blocks the kernel; re-enable after."""
        for control in self._control_widgets:
            control.disabled = busy
        if not busy:
            self._custom_box.disabled = self.gpu != CUSTOM_GPU
            self._optimizer_controls.enable()
            self._chunks_dropdown.disabled = bool(self._profile.loss_chunks_refusal)
            self._offload_dropdown.disabled = not self._cuda
            self._budget_dropdown.disabled = self.compile == COMPILE_OFF
            self._tp_dropdown.disabled = bool(self._tp_refusal)
            self._pp_dropdown.disabled = bool(self._pp_refusal)
            self._cp_dropdown.disabled = bool(self._cp_refusal)
            self._weights_dropdown.disabled = self._weights_held

    def _show_quietly(self: MemoryWidget, control: Any, value: object) -> None:  # type: ignore[misc]
        """Show ``value`` on ``control`` without feeding back into the traits."""
        syncing, self._syncing = self._syncing, True
        try:
            control.value = value
        finally:
            self._syncing = syncing

    def _sync_controls(self: MemoryWidget) -> None:  # type: ignore[misc]
        """Show the integer settings on their sliders and boxes without feeding back."""
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
            self._strategy_dropdown.value = self.strategy
            if list(self._tp_dropdown.options) != self._tp_options():
                self._tp_dropdown.options = self._tp_options()
            self._tp_dropdown.value = self.tp
            self._frontier_panel.selected_index = 0 if self._frontier_shown() else None
            self._sync_lever_choices()
            self._sync_compile_controls()
            self._sync_pipeline_controls()
            self._sync_rank_controls()
            self._sync_weights_control()
            self._sync_kv_cache_control()
        finally:
            self._syncing = False
        self._custom_box.disabled = self.gpu != CUSTOM_GPU


def _controls_in(box: widgets.Widget, kinds: tuple[type, ...]) -> list[widgets.DOMWidget]:
    """The controls inside ``box`` (depth first), boxes and labels left out."""
    if isinstance(box, widgets.Box):
        return [c for child in box.children for c in _controls_in(child, kinds)]
    return [box] if isinstance(box, kinds) else []
