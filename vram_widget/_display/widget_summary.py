"""The widget's numbers and words at a setting: the headline's numbers (those known at once
and those searched for once the controls rest), the details' rows, and the searches behind
them, each cached per setting (largest batch, longest sequence, GPUs needed, memory per
extra sample). The words themselves are :mod:`.widget_text`'s.
"""

from __future__ import annotations

import asyncio
import html
from typing import TYPE_CHECKING

from .._estimating.estimator import MemoryEstimate
from .._estimating.options import Mode
from .._estimating.sharding import resolve_parallel
from .optimizer_control import split_choice
from .widget_compile import NOT_SEARCHED
from .widget_controls import GPUS_MAX, SEQ_SLIDER_MAX
from .widget_parallel import context_parallel_text, expert_parallel_text
from .widget_pipeline import PP_NOT_SEARCHED, stages_text
from .widget_settings import weights_arg
from .widget_text import (
    Headline,
    allocator_text,
    breakdown_bar_html,
    data_parallel_text,
    device_text,
    extras_text,
    fit_figure,
    flops_text,
    format_bytes,
    generation_text,
    headline_html,
    host_row,
    levers_text,
    optimizer_text,
    rows_html,
    step_time_text,
    table_html,
)

if TYPE_CHECKING:
    from .widget import MemoryWidget

__all__ = ["AT_REST_DELAY_S", "DETAILS_TITLE", "SummaryMixin"]

# the rest after a move before the lines that search run (a kernel: _schedule_at_rest)
AT_REST_DELAY_S = 0.15
DETAILS_TITLE = "Details"
# how the optimizer steps (estimate's keywords, the widget's traits)
_STEPPING_SETTINGS = ("optimizer_in_backward", "set_to_none")
# in place of a search with tp > 1, where each batch or length is a sub-profile of its own
TP_NOT_SEARCHED = "not searched with tp > 1 (each batch is a profiling run of its own)"


class SummaryMixin:
    """The headline, bar, details and layers table of :class:`~.widget.MemoryWidget`.

    Its methods take the widget as ``self`` (``self: MemoryWidget``, which mypy checks
    against the widget's attributes but flags as a mixin's self-type: hence the ignores).
    """

    # the pending at-rest fill (a running kernel), and the headline's numbers as shown
    _at_rest_pending: asyncio.TimerHandle | None
    _headline_numbers: Headline | None

    # ------------------------------------------------------------------ derived numbers

    def largest_batch(self: MemoryWidget) -> int:  # type: ignore[misc]
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

    def bytes_per_sample(self: MemoryWidget) -> int:  # type: ignore[misc]
        """How much the peak grows per extra sample (cached per precision/optimizer/mode)."""
        key = self._settings_key("compute_capability", card=False)
        if key not in self._per_sample_cache:
            settings = self._settings()
            del settings["compute_capability"]  # the extras do not grow with the batch
            self._per_sample_cache[key] = self._profile.bytes_per_sample(**settings)
        return self._per_sample_cache[key]

    # ------------------------------------------------------------------ rendering

    def _render_text(self: MemoryWidget) -> None:  # type: ignore[misc]
        """The bar at once; the headline with what is known now, the rest at rest."""
        self._bar.value = breakdown_bar_html(self._estimate)
        self._schedule_at_rest()

    def _schedule_at_rest(self: MemoryWidget) -> None:  # type: ignore[misc]
        """The numbers that wait for the controls to rest, after the figure and the bar.

        ``device_bytes`` is a search of allocator replays under caps, a new setting's
        largest batch a search of estimates, the longest sequence and the fewest GPUs one
        per batch: more than a slider move may take. So in a running kernel the headline
        shows "…" for them, and they, the details and the layers table are filled in once
        the controls rest for ``AT_REST_DELAY_S`` (a new move cancels a pending one); with
        no event loop (a script, a test) at once."""
        if self._at_rest_pending is not None:
            self._at_rest_pending.cancel()
            self._at_rest_pending = None
        est = self._estimate
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._fill_at_rest(est)
            return
        self._render_headline(at_rest=False)
        self._details_panel.set_title(0, f"{DETAILS_TITLE} (updating…)")
        self._at_rest_pending = loop.call_later(AT_REST_DELAY_S, self._fill_at_rest, est)

    def _rest_now(self: MemoryWidget) -> None:  # type: ignore[misc]
        """Fill what waits for the controls' rest now, where it is pending: code that reads
        the words (``summary_html`` in a cell run while the kernel is busy, as "Run All"
        does) gets the current setting's numbers, never "…" or the last setting's details."""
        if self._at_rest_pending is not None:
            self._at_rest_pending.cancel()
            self._fill_at_rest(self._estimate)

    def _fill_at_rest(self: MemoryWidget, est: MemoryEstimate) -> None:  # type: ignore[misc]
        """What waits for the controls to rest: the headline's searches, the device and
        GPUs-needed rows, the details and the layers table."""
        self._at_rest_pending = None
        if est is not self._estimate:  # a setting moved away from since
            return
        target = self.target
        self._device_text = (
            "" if est.allocator is None else device_text(est, target.name, target.memory_bytes)
        )
        self._parallel_text = self._min_gpus_text(est)
        self._render_headline(at_rest=True)
        self._details.value = rows_html(self._detail_rows(est))
        self._details_panel.set_title(0, DETAILS_TITLE)
        self._table.value = table_html(est.layers, self.depth)

    def _render_headline(self: MemoryWidget, *, at_rest: bool) -> None:  # type: ignore[misc]
        numbers = self._headline_now(at_rest=at_rest)
        self._headline_numbers = numbers
        self._headline.value = headline_html(numbers)

    def _headline_now(self: MemoryWidget, *, at_rest: bool) -> Headline:  # type: ignore[misc]
        """The headline's numbers: those that are cheap or cached now, the searches only
        ``at_rest`` (None until then)."""
        est = self._estimate
        target = self.target
        capacity = target.memory_bytes
        fit_bytes, label = fit_figure(est)
        if fit_bytes is None and at_rest:
            device = est.device_bytes
            fit_bytes = est.total_bytes if device is None else device
        below = self._below_context(capacity)
        key = self._settings_key()
        largest: int | None = self._fit_cache.get(key)
        # the compiled step and a tensor-parallel rank are profiled at each batch: no
        # search over the batch (the compiled step's note at rest, as its searches would be)
        note = ""
        if self._compiled and at_rest:
            note = NOT_SEARCHED
        elif self._tensor_parallel:
            note = TP_NOT_SEARCHED
        elif self._pipeline_parallel:
            note = PP_NOT_SEARCHED
        elif self._rank_parallel:
            note = self._ranks_note
        if largest is None and (at_rest or below) and not self._per_batch:
            largest = self.largest_batch()
        largest_note = "" if below else note
        longest = None
        longest_note = note
        if self._profile.has_seq_axis and not below and not self._per_batch:
            seq_key = (self.batch_size, *self._settings_key("seq_len"))
            longest = self._seq_cache.get(seq_key)
            if seq_key not in self._seq_cache and at_rest:
                longest = self.longest_sequence()
            if longest is None and at_rest:
                longest_note = (
                    "n/a (memory is not a verified polynomial in the length here: see the "
                    "batch x length panel)"
                    if self._length_fit_tried()
                    else "? (move the sequence length once to fit the profile in it)"
                )
        tokens = None
        if est.generation is not None:
            tokens = est.batch_size * est.generation.new_tokens
        elif est.seq_len is not None:
            tokens = est.batch_size * est.seq_len
        return Headline(
            gpu_name=target.name,
            capacity_bytes=capacity,
            fit_bytes=fit_bytes,
            fit_label=label,
            fits=None if fit_bytes is None else fit_bytes <= capacity,
            largest_batch=largest,
            longest_seq=longest,
            longest_seq_note=longest_note,
            largest_batch_note=largest_note,
            has_seq_axis=self._profile.has_seq_axis,
            generating=est.generation is not None,
            flops=est.flops,
            batch_size=est.batch_size,
            tokens_count=tokens,
            below_context_bytes=est.extras.cuda_context_bytes if below else None,
            error=self._error,
        )

    def longest_sequence(self: MemoryWidget) -> int | None:  # type: ignore[misc]
        """:meth:`ModelProfile.max_seq_len` at the current batch, setting and card (the
        longest prompt in a generation; cached). None without a sequence axis, before the
        profile has been fitted in the length at this setting (the search would profile:
        moving the sequence length once, or opening the batch x length panel, fits it), or
        where the search fails (the estimate at that length says why)."""
        if not self._profile.has_seq_axis or not self._length_fitted():
            return None
        key = (self.batch_size, *self._settings_key("seq_len"))
        if key not in self._seq_cache:
            capacity = self.target.memory_bytes
            s = self._settings()
            del s["seq_len"]
            try:
                found: int | None = (
                    0
                    if self._below_context(capacity)
                    else self._profile.max_seq_len(capacity, self.batch_size, **s)
                )
            except Exception:  # a length the model refuses (past its positions): not shown
                found = None
            self._seq_cache[key] = found
        return self._seq_cache[key]

    def _length_fit_tried(self: MemoryWidget) -> bool:  # type: ignore[misc]
        """Whether the profile's fit in the length has been tried at this setting."""
        levers = self._step_levers()
        return levers is not None and self._profile.length_fit_tried(
            self.precision, self.mode, levers
        )

    def _length_fitted(self: MemoryWidget) -> bool:  # type: ignore[misc]
        """Whether other lengths are numpy at this setting: the fit in the length is made
        and verified, so an estimate at the shortest, a longer and the longest length needs
        no profiling run (``ModelProfile.is_cached``). Only then is the longest sequence
        searched for at rest: where lengths are profiled one by one, that search would hold
        the kernel for seconds (the batch x length panel says so and profiles them)."""
        levers = self._step_levers()
        if levers is None or not self._length_fit_tried():
            return False
        s = self._settings()
        try:
            parallel = resolve_parallel(self.gpus, self.strategy, gpus_per_node=self.gpus_per_node)
        except ValueError:  # the estimate says why
            return False
        limit = self._profile.seq_len_limit or SEQ_SLIDER_MAX
        if self._generating and self._profile.generation_limit is not None:
            # a generation's prompt: the new tokens follow it within the positions
            limit = max(1, min(limit, self._profile.generation_limit - self.new_tokens))
        probes = {1, min(2 * (self.seq_len or 1), limit), limit}
        return all(
            self._profile.is_cached(
                self.precision, self.mode, s["optimizer"], length, levers, parallel,
                s["new_tokens"],
            )
            for length in probes
        )  # fmt: skip

    @property
    def parallel_html(self: MemoryWidget) -> str:  # type: ignore[misc]
        """The "GPUs needed" row's HTML (training): the fewest GPUs of the chosen card on
        which the current setting fits, per rank, with the chosen strategy."""
        self._rest_now()
        return self._parallel_text

    def min_gpus(self: MemoryWidget) -> int | None:  # type: ignore[misc]
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

    def _min_gpus_text(self: MemoryWidget, est: MemoryEstimate) -> str:  # type: ignore[misc]
        # data-parallel ranks only
        # (the ep or cp ranks are the whole world: no data-parallel ranks to add)
        if est.mode is not Mode.TRAIN or self._tensor_parallel or self._pipeline_parallel:
            return ""
        if self._rank_parallel:
            return ""
        card = html.escape(self.target.name)
        try:
            needed = self.min_gpus()
        except ValueError as exc:  # more than one GPU, where a setting is one GPU's only
            return f"more than one {card} at batch {self.batch_size:,}; {html.escape(str(exc))}"
        if needed is None:
            return (
                f"no number up to {GPUS_MAX:,} fits {card} with {self.strategy} at batch "
                f"{self.batch_size:,} per GPU ("
                + (
                    "DDP keeps the whole model, its gradients and optimizer state on every "
                    "GPU; zero1 shards the optimizer state)"
                    if self.strategy == "ddp"
                    else "the state it shards is not what fills the card)"
                )
            )
        return (
            f"{needed:,} x {card} with {self.strategy} at batch {self.batch_size:,} per GPU "
            f"(global batch {needed * self.batch_size:,})"
        )

    def _detail_rows(self: MemoryWidget, est: MemoryEstimate) -> list[tuple[str, str]]:  # type: ignore[misc]
        """The details as labelled rows (label, HTML), at rest."""
        profile = self._profile
        asked = split_choice(self.optimizer)[1] is not None
        rows = [
            (
                "Model",
                f"<b>{html.escape(profile.model_name or 'model')}</b>: "
                f"{profile.param_count:,} parameters ({profile.trainable_param_count:,} "
                f"trainable); {est.mode.value}, batch {est.batch_size:,} (inputs: "
                f"{html.escape(profile.input_shape)}), {est.precision.value}"
                f"{optimizer_text(est, asked)}, for {est.device.value} kernels",
            ),
            (
                "Peak",
                f"{format_bytes(est.peak_bytes)} ({est.peak_bytes:,} B) in "
                f"{html.escape(est.peak_location)}",
            ),
        ]
        if est.weights or est.float8:  # the estimate's own description of them
            rows.append(("Weights", html.escape(est.weights or est.float8)))
        # the weights and buffers once loaded, before any step (load_bytes): its layout is
        # a meta build of the model, made when the widget opens or a weights choice is
        # profiled, never on a slider move
        weights = weights_arg(self.weights, self.precision)
        try:
            if profile.load_is_cached(precision=est.precision, weights=weights):
                loaded = profile.load_bytes(precision=est.precision, weights=weights)
                rows.append(("Loaded", html.escape(loaded.summary())))
            else:
                rows.append(("Loaded", "profile.load_bytes(precision=..., weights=...) gives it"))
        except (ValueError, TypeError, ImportError) as exc:  # the step's own row says why
            rows.append(("Loaded", html.escape(str(exc))))
        if est.generation is not None:
            rows.append(("Generation", generation_text(est)))
        elif est.seq_len is not None:
            rows.append(
                (
                    "Tokens per step",
                    f"{est.batch_size:,} x {est.seq_len:,} = {est.batch_size * est.seq_len:,}",
                )
            )
        if est.levers.active:
            rows.append(("Levers", levers_text(est, self._without_levers())))
        host = host_row(est)
        if host is not None:  # activation offloading: host memory, apart from the device's
            rows.append(host)
        if est.pp > 1:  # each stage's peak; the batch is the whole step's
            rows.append(("Pipeline stages", stages_text(est)))
        elif est.ep > 1:  # one rank's, the tokens routed evenly; the skewed bound beside it
            rows.append(("Expert parallel", expert_parallel_text(est)))
        elif est.cp > 1:  # one rank's share of the sequence; UNCONFIRMED
            rows.append(("Context parallel", context_parallel_text(est)))
        elif est.gpus > 1:
            rows.append(("Data parallel", data_parallel_text(est)))
        rows.append(("Extras (reserve)", extras_text(est)))
        ignored = (*self._ignored, *est.ignored)
        if ignored:  # what the setup runs that the estimate leaves out, never dropped
            rows.append(("Not estimated", "; ".join(html.escape(i) for i in ignored)))
        reserved = allocator_text(est)
        if reserved:
            rows.append(("Reserved", reserved))
        if self._device_text:
            rows.append(("On the device", self._device_text))
        if self._parallel_text:
            rows.append(("GPUs needed", self._parallel_text))
        sample = "sequence" if est.generation is not None else "sample"
        per_sample = (
            NOT_SEARCHED if self._compiled
            else TP_NOT_SEARCHED if self._tensor_parallel
            else PP_NOT_SEARCHED if self._pipeline_parallel
            else self._ranks_note if self._rank_parallel
            else format_bytes(self.bytes_per_sample())
        )  # fmt: skip
        rows.append((f"Memory per extra {sample}", per_sample))
        per = "of the generation" if est.generation is not None else "per step"
        rows.append((f"FLOPs {per}", flops_text(est)))
        rate = self.target.peak_flops_per_s(self.precision)
        rows.append(
            (
                f"{'Generation' if est.generation is not None else 'Step'} time",
                step_time_text(est, rate),
            )
        )
        if not est.exact:
            rows.append(
                (
                    "Extrapolated",
                    "memory is not a polynomial the profile could verify in the batch size "
                    "for this model: estimates away from the profiled batches are extrapolated",
                )
            )
        return rows

    def _without_levers(self: MemoryWidget) -> MemoryEstimate:  # type: ignore[misc]
        """The same step without the levers (what the levers row compares with)."""
        plain = {
            *self._lever_settings(),
            *_STEPPING_SETTINGS,
            "loss_chunks",
            "offload_activations",
            "compile",
            "activation_memory_budget",
        }
        settings = {k: v for k, v in self._settings().items() if k not in plain}
        return self._profile.estimate(self.batch_size, **settings)
