"""The runs a profile's source makes when the table first asks for a timeline: each precision,
mode, set of levers and length fitted over batch sizes, derived from copies with fewer
repeated blocks where exact, and profiled by a real CPU run where fake tensors cannot run it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .._estimating.decoding import DECODE_STEPS_PROFILED
from .._estimating.estimator import module_label
from .._estimating.levers import NO_LEVERS, Levers
from .._estimating.options import (
    Mode,
    OptimizerChoice,
    OptimizerImplementation,
    Precision,
)
from .._estimating.profile_source import ProfilingError
from .._estimating.table import (
    PADDED_TERMS,
    NotAffineError,
    OptimizerTrace,
    Timeline,
    across_lengths,
    fit_timeline,
    padded_fit_lengths,
    same_step,
)
from .data_dependent import example_mask_values, graph_randomness, worst_case_graph
from .fake import (
    DATA_DEPENDENT_ERRORS,
    quiet_third_party,
)
from .repeated import (
    FEW_BLOCKS,
    BlockStack,
    NotRepeated,
    derive,
    find_stack,
    full_param_names,
    layout,
    reduced_levers,
)
from .step_profiler import (
    FIT_BATCH_SIZES,
    QUADRATIC_CHECK_BATCH,
    WORKSPACE_BATCH_SIZES,
    Profiler,
    _plain_stepping,
)
from .subject import (
    RawTrace,
    _preserved_model_state,
)
from .workspace_grid import refined_workspaces

if TYPE_CHECKING:
    from .profiler import _Source


class SourceRuns:
    """The timelines :class:`~.profiler._Source` profiles when the table first asks: the
    fit across batch sizes (and lengths), derived runs of repeated blocks, the fallback to a
    real run, and the optimizer's trace."""

    # Whether a stack of identical blocks is recorded with 3 and 4 of them and the run
    # with all of them derived, where exact (repeated.py); False runs every step in full.
    use_repeated = True

    if TYPE_CHECKING:  # profiler._Source builds the source of each reduced copy

        def _reduced_source(self, stack: BlockStack, n: int) -> _Source: ...

    def __init__(self, profiler: Profiler, cache: object = True) -> None:
        self.profiler = profiler
        self.cache = cache  # profile_model's cache=, which a LoRA profile inherits
        self._stack: BlockStack | bool | None = False  # False: not looked for yet
        self._reduced: dict[int, _Source] = {}
        # (precision, mode, levers, length) whose runs the few-block copies do not give
        self._not_repeated: set[tuple[Any, ...]] = set()
        # (tp, the plan's id, the single-rank Recipe) -> (the plan, one rank's estimate)
        self._tensor_parallel: dict[tuple[Any, ...], tuple[object, Any]] = {}
        self._expert_parallel: dict[tuple[Any, ...], Any] = {}
        # (cp, the whole sequence's length, the single-rank Recipe) -> one rank's estimate
        self._context_parallel: dict[tuple[Any, ...], Any] = {}
        # the arguments of pipeline_stage_peaks -> each stage's StagePeak
        self._pipeline: dict[Any, tuple[Any, ...]] = {}  # StageQuestion -> the stages
        # the arguments of float8_fsdp_step -> the rank's Float8RankStep
        self._float8_fsdp: dict[tuple[Any, ...], Any] = {}
        # a new meta copy of the profiled model, for a sub-profile to convert (None:
        # step.meta_copy of it). A tensor-parallel rank's is the plan applied to a new copy
        # of the whole model: transformers' styles replace each sharded module's forward by
        # a closure over that module (transformers/distributed/tensor_parallel.py,
        # TensorParallelLayer.install_forward), which a deep copy would still call.
        self.fresh_model: Callable[[], torch.nn.Module] | None = None
        # the one batch size the steps are recorded at, as they are there (no slope; None:
        # fitted over FIT_BATCH_SIZES). An expert-parallel rank's: its tokens are split over
        # the ranks by torch.chunk (transformers' AllToAllEP), unevenly where the batch's
        # tokens do not divide, so the step is not one polynomial in the batch
        self.at_batch: int | None = None

    def timeline(
        self,
        precision: Precision,
        mode: Mode,
        seq_len: int | None = None,
        levers: Levers = NO_LEVERS,
    ) -> Timeline:
        self.profiler.seq_len = seq_len
        try:
            if mode is Mode.TRAIN and _plain_stepping(levers) != levers:
                # which parameters a step gives a gradient (those set_to_none=False keeps
                # between steps, those an optimizer in backward has state for) is read from
                # the plain step; one run of it, where not known yet
                freeing = _plain_stepping(levers)
                if freeing not in self.profiler.subject.params_with_grad:
                    self.profiler.levers = freeing
                    self._run(precision, FIT_BATCH_SIZES[0], mode, flops=False)
            self.profiler.levers = levers
            # the compiled step at the asked batch, as it is there (no slope): the partition
            # may change with the batch (compiled.decided_at); or the source's one batch
            at = levers.compile_batch if levers.compile_batch is not None else self.at_batch
            if at is not None:
                trace = self._run(precision, at, mode)
                return fit_timeline((trace,), trace)
            return self._timeline(precision, mode)
        finally:
            self.profiler.seq_len = None
            self.profiler.levers = NO_LEVERS

    def _timeline(self, precision: Precision, mode: Mode) -> Timeline:
        # FLOPs are fitted from the first two runs (batch 1 does not count them)
        fit = tuple(self._run(precision, b, mode) for b in FIT_BATCH_SIZES[:2])
        grid: list[RawTrace] = []
        if self.profiler.probe is not None and len(fit[0].workspace_storages):
            grid = self._grid_runs(precision, mode)
        # Batch 1 is run anyway (it may take paths of its own). Where it is the fit's step at
        # 1, to the byte, it is the check too, and the step costs three runs; where not, a
        # third batch size checks the fit and batch 1 is kept as it is. Where CPU kernel
        # workspaces are measured, the third batch size is a point of their interpolation
        # grid too, so it always runs.
        one = self._batch_one(precision, mode, grid)
        if not grid and one is not None and same_step(fit[0], one):
            timeline = fit_timeline(fit, one, tuple(grid))
            if timeline.exact:
                return timeline
        third = self._run(precision, FIT_BATCH_SIZES[2], mode)  # FLOPs for a quadratic
        try:
            timeline = fit_timeline(fit, third, tuple(grid))
            if not timeline.exact and same_step(fit[0], third):
                # The same step, but not a line in the batch: memory quadratic in it (a
                # loss over every pair of samples, CLIP's B x B logits). Three runs give
                # the quadratic, checked exactly at a fourth batch size.
                quadratic = self._quadratic(precision, mode, [*fit, third], grid)
                if quadratic.exact:
                    timeline = quadratic
        except NotAffineError as exc:
            raise ProfilingError(
                f"cannot fit memory to the batch size: {exc}; first difference "
                f"{self._where(exc.row)}. Randomness that changes which layers run "
                "(a random skip, early exit) or shapes that depend on values do this"
            ) from None
        if not timeline.exact and not self.profiler.real:  # the fallback already warned
            off = ""
            if timeline.check_peaks is not None:
                batch, fitted, profiled = timeline.check_peaks
                off = (
                    f": at batch {batch} the fitted peak is {fitted - profiled:+,} bytes "
                    f"({(fitted - profiled) / max(profiled, 1):+.1%}) off the profiled one, "
                    "and the error grows with the distance (memory quadratic in the batch, "
                    "a B x B similarity matrix, grows faster than any line through two points)"
                )
            warnings.warn(
                "memory is not affine in the batch size (first seen "
                f"{self._where(timeline.nonaffine_row)}); estimates away from batch "
                f"{FIT_BATCH_SIZES[0]}-{FIT_BATCH_SIZES[1]} are extrapolated{off}",
                UserWarning,
                stacklevel=4,
            )
        if grid and self.profiler.probe is not None:  # workspaces between the grid's points
            timeline = refined_workspaces(timeline, [*fit, third, *grid], self.profiler.probe)
        return self._with_batch_one(timeline, fit[0], one, grid)

    def _batch_one(self, precision: Precision, mode: Mode, grid: list[RawTrace]) -> RawTrace | None:
        """The step at batch 1 (from the CPU workspace grid where it ran there); None where
        the model refuses a batch of one (BatchNorm in training on a 1x1 map)."""
        one = next((t for t in grid if t.batch_size == 1), None)
        if one is not None:
            return one
        try:
            return self._run(precision, 1, mode, flops=False)
        except ProfilingError:
            return None

    def _with_batch_one(
        self,
        timeline: Timeline,
        fitted_trace: RawTrace,
        one: RawTrace | None,
        grid: list[RawTrace],
    ) -> Timeline:
        """``timeline`` with the step at batch 1 where that step is not the fit's at 1.

        The fit runs at batch 2 and up, because at 1 code takes other paths: size-1
        dimensions broadcast, squeeze and fold (GPT-2's eager attention trains at batch 1
        with one more copy of its scores than the line through 2 and 3 says: -65,536 bytes
        at 64 tokens). So batch 1 is kept as it is where it differs."""
        if one is None:
            return timeline
        if same_step(fitted_trace, one):
            measured = np.isin(one.event_storage, one.workspace_storages)  # interpolated
            fitted = np.where(measured, 0, timeline.events_at(1))
            if np.array_equal(fitted, np.where(measured, 0, one.event_bytes)):
                return timeline
        at_one = fit_timeline((one,), one, tuple(grid))
        # FLOPs are the fit's (the same ops count the same at batch 1)
        at_one = dataclasses.replace(
            at_one,
            flops_forward=timeline.flops_forward,
            flops_backward=timeline.flops_backward,
            step_flops=timeline.step_flops,
        )
        return dataclasses.replace(timeline, batch_one=at_one)

    def _where(self, row: int | None) -> str:
        """A module row as a person reads it: ``in module 'encoder.layers.3' (Wav2Vec2Layer)``."""
        rows = self.profiler.subject.rows
        if row is None or not 0 <= row < len(rows.names):
            return "at the end of the step"
        return f"in module {module_label(rows, row)!r} ({rows.types[row]})"

    def generation(
        self,
        precision: Precision,
        seq_len: int | None,
        *,
        decode_steps: int = DECODE_STEPS_PROFILED,
        new_tokens: int | None = None,
    ) -> Timeline:
        """A generation recorded at the prompt ``seq_len`` (None: the example's) through
        ``decode_steps`` decode steps (more across a sliding window, ``decoding._plan``), with
        generate asked for ``new_tokens`` (a ``StaticCache`` is allocated for the prompt and
        all of them before the first step; None: just more than are recorded), fitted in the
        batch."""
        self.profiler.seq_len = seq_len
        self.profiler.decode_steps = decode_steps
        self.profiler.generation_tokens = new_tokens
        try:
            return self._timeline(precision, Mode.GENERATE)
        finally:
            self.profiler.seq_len = None
            self.profiler.decode_steps = DECODE_STEPS_PROFILED
            self.profiler.generation_tokens = None

    def timeline_across_lengths(
        self, precision: Precision, mode: Mode, base: Timeline, levers: Levers = NO_LEVERS
    ) -> Timeline | None:
        """The timeline as a polynomial in (batch, seq), from ``base`` (the example's
        length) and runs at two more lengths, checked exactly at a fourth length and another
        batch size. Where that check fails, three more lengths fit it in the length and the
        padding kernels add to a multiple (``PADDED_TERMS``), checked at another length.
        None where memory is neither (windows, kernel choices that switch with the length),
        where the batch fit is quadratic or extrapolated, or where CPU kernel workspaces are
        measured."""
        s0 = self.profiler.subject.seq_len
        if s0 is None or not base.exact or base.event_bytes.degree > 1:
            return None
        if len(base.workspace_alloc_at):
            return None
        # Where batch 1 takes its own path, it is run at each length too and fitted apart.
        lines: dict[int, Timeline] = {s0: base}
        ones: dict[int, Timeline] | None = None
        if base.batch_one is not None:
            ones = {s0: base.batch_one}

        def profile_lengths(lengths: Sequence[int]) -> None:
            for length in lengths:
                if length in lines:
                    continue
                self.profiler.seq_len = length
                t2, t3 = (self._run(precision, b, mode) for b in FIT_BATCH_SIZES[:2])
                lines[length] = fit_timeline((t2, t3), t3)
                if ones is not None:
                    one = self._run(precision, 1, mode, flops=False)
                    ones[length] = fit_timeline((one,), one)

        def fitted(
            lengths: tuple[int, ...], check_len: int, terms: tuple[tuple[int, int], ...] | None
        ) -> Timeline | None:
            profile_lengths(lengths)
            self.profiler.seq_len = check_len
            check = self._run(precision, FIT_BATCH_SIZES[2], mode, flops=False)
            combined = across_lengths(
                lengths, tuple(lines[n] for n in lengths), check, check_len, terms
            )
            if combined is None or ones is None:
                return combined
            check_one = self._run(precision, 1, mode, flops=False)
            combined_one = across_lengths(
                lengths, tuple(ones[n] for n in lengths), check_one, check_len, terms, flops=False
            )
            if combined_one is None:
                return None
            combined_one = dataclasses.replace(
                combined_one,
                flops_forward=combined.flops_forward,
                step_flops=combined.step_flops,
                flops_backward=combined.flops_backward,
            )
            return dataclasses.replace(combined, batch_one=combined_one)

        self.profiler.levers = levers
        try:
            # Lengths far from the example and from multiples of 8, so that padding or a
            # window the example does not reach shows at the check rather than in an answer.
            plain = fitted((s0, 2 * s0 + 1, 3 * s0 + 2), 4 * s0 + 3, None)
            if plain is not None:
                return plain
            lengths, check_len = padded_fit_lengths(s0, PADDED_TERMS)
            return fitted(lengths, check_len, PADDED_TERMS)
        except (NotAffineError, ProfilingError):
            return None
        finally:
            self.profiler.seq_len = None
            self.profiler.levers = NO_LEVERS

    def _quadratic(
        self, precision: Precision, mode: Mode, traces: list[RawTrace], grid: list[RawTrace]
    ) -> Timeline:
        check = next((t for t in grid if t.batch_size == QUADRATIC_CHECK_BATCH), None)
        if check is None:
            check = self._run(precision, QUADRATIC_CHECK_BATCH, mode, flops=False)
        return fit_timeline(tuple(traces[:3]), check, tuple(grid))

    def _grid_runs(self, precision: Precision, mode: Mode) -> list[RawTrace]:
        """Runs at the extra workspace batch sizes; one the model cannot run (BatchNorm in
        training rejects batch 1 on a 1x1 map) is left out of the grid, not an error."""
        traces = []
        for batch in WORKSPACE_BATCH_SIZES:
            try:
                traces.append(self._run(precision, batch, mode, flops=False))
            except ProfilingError:
                continue
        return traces

    def _example(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The example batch as the user gave it (positional, keyword): its values decide
        what fake tensors cannot (``data_dependent``)."""
        inputs = self.profiler.subject.inputs
        return ((), {}) if inputs is None else (inputs.args, inputs.kwargs)

    @contextlib.contextmanager
    def _as_every_run(self) -> Iterator[None]:
        """What wraps every run, the lazy ones a later estimate() asks for and the check
        included: the model's training flags and the RNG left as they were, the worst-case
        graph, the example's mask values, and a backward recorded even when the caller sits
        inside torch.no_grad() or torch.inference_mode()."""
        model = self.profiler.subject.model
        with (
            _preserved_model_state(model),
            worst_case_graph(graph_randomness(model)),
            example_mask_values(model, *self._example()),
            torch.inference_mode(False),
            torch.enable_grad(),
        ):
            yield

    def _run(
        self, precision: Precision, batch_size: int, mode: Mode, flops: bool = True
    ) -> RawTrace:
        derived = self._derived_run(precision, batch_size, mode, flops)
        if derived is not None:
            return derived
        with self._as_every_run():
            return self._run_once(precision, batch_size, mode, flops)

    def _derived_run(
        self, precision: Precision, batch_size: int, mode: Mode, flops: bool
    ) -> RawTrace | None:
        """The run from copies of the model with 3 and 4 of its repeated blocks
        (``repeated.py``), where that is exact; None where not (the full run is made)."""
        profiler = self.profiler
        subject = profiler.subject
        if not self.use_repeated or profiler.real or profiler.probe is not None:
            return None
        if profiler.record_collectives:  # each run's own collectives: run in full
            return None
        if mode not in (Mode.TRAIN, Mode.INFERENCE) or subject.fixed_dtypes:
            return None
        if self._stack is False:
            self._stack = find_stack(subject.model)
        stack = self._stack
        if not isinstance(stack, BlockStack):
            return None
        levers = profiler.levers if mode is Mode.TRAIN else NO_LEVERS
        key = (precision, mode, levers, profiler.seq_len)
        if key in self._not_repeated:
            return None
        traces, reduced = [], []
        for n in FEW_BLOCKS:
            few = reduced_levers(levers, stack, n)
            if few is None:
                self._not_repeated.add(key)
                return None
            source = self._reduced_source(stack, n)
            source.profiler.seq_len, source.profiler.levers = profiler.seq_len, few
            try:
                traces.append(source._run(precision, batch_size, mode, flops))
            except Exception:
                self._not_repeated.add(key)
                return None
            finally:
                source.profiler.seq_len, source.profiler.levers = None, NO_LEVERS
            reduced.append((source.profiler.subject, few))
        (sub3, few3), (sub4, _few4) = reduced
        try:
            trace = derive(
                traces[0],
                traces[1],
                layout(sub3.rows.names, stack, FEW_BLOCKS[0]),
                layout(sub4.rows.names, stack, FEW_BLOCKS[1]),
                layout(subject.rows.names, stack, stack.count),
                len(subject.rows.names),
            )
        except NotRepeated:
            self._not_repeated.add(key)
            return None
        if few3 in sub3.params_with_grad:
            subject.params_with_grad[levers] = full_param_names(
                sub3.params_with_grad[few3], stack, [n for n, _p, _r in subject._params]
            )
        assert isinstance(trace, RawTrace)
        return trace

    def check_runs(self) -> bool:
        """:meth:`Profiler.check_runs` inside the wrappers of every run."""
        with self._as_every_run():
            return self.profiler.check_runs()

    def _run_once(self, precision: Precision, batch_size: int, mode: Mode, flops: bool) -> RawTrace:
        try:
            return self.profiler.run(precision, batch_size, mode, flops)
        except DATA_DEPENDENT_ERRORS as exc:
            subject = self.profiler.subject
            if self.profiler.real:
                raise
            if any(p.device.type == "meta" for _n, p, _r in subject._params):
                raise ProfilingError(
                    "fake tensors cannot run this model (an op's output depends on tensor "
                    f"values: {type(exc).__name__}), and a model on the meta device has no "
                    "values for a real run"
                ) from None
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            subject.fallback_reason = reason
            self.profiler.real = True
            warn_fallback(reason)
            return self.profiler.run(precision, batch_size, mode, flops)

    def optimizer_trace(
        self,
        precision: Precision,
        optimizer: OptimizerChoice,
        levers: Levers = NO_LEVERS,
        only: tuple[str, ...] | None = None,
        shard: tuple[int, int] | None = None,
        implementation: OptimizerImplementation | None = OptimizerImplementation.FORLOOP,
    ) -> OptimizerTrace:
        self.profiler.levers = levers
        try:
            with torch.inference_mode(False), torch.enable_grad(), quiet_third_party():
                return self.profiler.run_optimizer(
                    precision, optimizer, only, shard, implementation
                )
        finally:
            self.profiler.levers = NO_LEVERS


def warn_fallback(reason: str) -> None:
    warnings.warn(
        "fake tensors cannot run this model "
        f"({reason}); profiled with a real run on the CPU at tiny batch sizes instead. "
        "Memory that depends on tensor values (data-dependent shapes) is what those batches "
        "gave, and may differ for other data.",
        UserWarning,
        stacklevel=3,
    )
