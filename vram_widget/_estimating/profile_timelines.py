"""The timelines a profile holds: which are cached, the sequence axis and its checks, and the
runs its source is asked for on first use. No torch here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .compiled import decided_at
from .decoding import (
    crosses_window,
)
from .levers import NO_LEVERS, Levers
from .options import (
    Mode,
    OptimizerChoice,
    OptimizerImplementation,
    OptimizerName,
    Precision,
    default_implementation,
    parse_optimizer_choice,
    parse_option,
)
from .profile_source import ProfilingError
from .profile_step import (
    _optimizer_levers,
    _profiled,
    _scaled_flops,
    _step_levers,
)
from .sharding import (
    SINGLE_DEVICE,
    Parallel,
)
from .table import OptimizerTrace, Timeline

if TYPE_CHECKING:
    from .profile import ModelProfile


class TimelinesMixin:
    """The timelines :class:`~.profile.ModelProfile` holds and asks its source for (``self`` is
    the profile)."""

    def is_cached(  # type: ignore[misc]
        self: ModelProfile,
        precision: str | Precision,
        mode: str | Mode = Mode.TRAIN,
        optimizer: str | OptimizerName | None = None,
        seq_len: int | None = None,
        levers: Levers = NO_LEVERS,
        parallel: Parallel = SINGLE_DEVICE,
        new_tokens: int | None = None,
        batch_size: int | None = None,
    ) -> bool:
        """Whether an estimate at this precision, mode (in training, optimizer), sequence
        length, levers and data parallelism needs no further profiling run (FSDP2 under
        autocast steps on half-precision parameters: a run of its own; a generation of
        ``new_tokens`` across a sliding window, one recorded across it). A compiled step
        (``levers.compile``) is profiled at its batch size (``compiled.decided_at``):
        ``batch_size``, where ``levers.compile_batch`` does not say it; without either, a
        compiled step is not known to be cached (False)."""
        prec = parse_option(Precision, precision, "precision")
        run_mode = parse_option(Mode, mode, "mode")
        if run_mode is Mode.TRAIN and levers.compile is not None and levers.compile_batch is None:
            if batch_size is None:
                return False
            levers = decided_at(levers, batch_size)
        if levers.lora_rank is not None and run_mode is Mode.TRAIN:
            made = self._made_lora(levers)
            return made is not None and made[0].is_cached(
                prec, run_mode, optimizer, seq_len, made[1], parallel
            )
        if run_mode is Mode.GENERATE and self.cache_implementation == "static":
            length = None if seq_len == self.seq_len else seq_len
            return (prec, length) in self._static_caches
        if run_mode is Mode.GENERATE and new_tokens is not None:
            steps = self._flush_steps(new_tokens)
            if steps is not None:  # recorded through its flushes
                length = None if seq_len == self.seq_len else seq_len
                return (prec, length, steps) in self._across_flushes
        levers = _step_levers(levers, run_mode, parallel, prec)
        key = (prec, run_mode, _profiled(levers, run_mode))
        if key not in self._timelines:
            return False
        if seq_len is not None and seq_len != self.seq_len:
            if key not in self._across_lengths:
                return False  # the fit in the length runs first
            fitted = self._across_lengths[key]
            no_fit = fitted is None or not self._same_side_of_window(seq_len)
            if no_fit and (*key, seq_len) not in self._other_lengths:
                return False  # profiled at that length
        if run_mode is Mode.GENERATE and new_tokens is not None:
            prompt = self.seq_len if seq_len is None else seq_len
            forwards = len(self.timeline(prec, run_mode, seq_len).step_starts) - 1  # cached
            crossing = prompt is not None and crosses_window(
                prompt, new_tokens, forwards, self.seq_window
            )
            if crossing and prec not in self._across_windows:
                return False
        opt, impl = parse_optimizer_choice(optimizer)
        impl = impl or default_implementation(self.device)
        return (
            run_mode is not Mode.TRAIN  # no optimizer outside training
            or opt is None
            or levers.in_backward is not None  # its steps are in the timeline
            or (prec, opt, _optimizer_levers(levers), None, None, impl) in self._optimizers
        )

    def length_fit_tried(  # type: ignore[misc]
        self: ModelProfile,
        precision: str | Precision,
        mode: str | Mode = Mode.TRAIN,
        levers: Levers = NO_LEVERS,
    ) -> bool:
        """Whether the fit in the sequence length has been made (or found impossible) for
        this precision, mode and levers: from then on, which other lengths are numpy is
        known."""
        prec = parse_option(Precision, precision, "precision")
        run_mode = parse_option(Mode, mode, "mode")
        if levers.lora_rank is not None and run_mode is Mode.TRAIN:
            made = self._made_lora(levers)
            return made is not None and made[0].length_fit_tried(prec, run_mode, made[1])
        return (prec, run_mode, _profiled(levers, run_mode)) in self._across_lengths

    def _same_side_of_window(self: ModelProfile, seq_len: int) -> bool:  # type: ignore[misc]
        window = self.seq_window
        return (
            window is None or self.seq_len is None or (seq_len < window) == (self.seq_len < window)
        )

    @property
    def has_seq_axis(self: ModelProfile) -> bool:  # type: ignore[misc]
        """Whether ``estimate(seq_len=...)`` can vary the sequence length."""
        return self.seq_len is not None

    def check_seq_len(self: ModelProfile, seq_len: object) -> int | None:  # type: ignore[misc]
        """``seq_len`` validated (ValueError / TypeError naming the problem); None where it is
        None or the example's own length."""
        if seq_len is None:
            return None
        if not self.has_seq_axis:
            raise ValueError(
                f"seq_len={seq_len!r}: this profile has no sequence axis (inputs: "
                f"{self.input_shape}; {self._no_seq_reason})"
            )
        if isinstance(seq_len, bool) or not isinstance(seq_len, int | np.integer):
            raise TypeError(f"seq_len must be a positive integer, got {seq_len!r}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len} (inputs: {self.input_shape})")
        if self.seq_len_limit is not None and seq_len > self.seq_len_limit:
            raise ValueError(
                f"seq_len={seq_len} is beyond the model's {self.seq_len_limit} learned "
                "positions (config.max_position_embeddings): a real step would index past "
                "its position table"
            )
        return None if seq_len == self.seq_len else int(seq_len)

    def timeline(  # type: ignore[misc]
        self: ModelProfile,
        precision: Precision,
        mode: Mode,
        seq_len: int | None = None,
        levers: Levers = NO_LEVERS,
    ) -> Timeline:
        asked = levers if mode is Mode.TRAIN else NO_LEVERS
        profiled = _profiled(levers, mode)
        timeline = self._profiled_timeline(precision, mode, seq_len, profiled)
        if asked.grad_accumulation > profiled.grad_accumulation:
            # k > 2 micro-batches: the memory of 2, the FLOPs of k (2 profiled: exact halves)
            timeline = _scaled_flops(timeline, asked.grad_accumulation, 2)
        return timeline

    def _profiled_timeline(  # type: ignore[misc]
        self: ModelProfile, precision: Precision, mode: Mode, seq_len: int | None, levers: Levers
    ) -> Timeline:
        if seq_len is not None and seq_len != self.seq_len:
            # Another length. Once per setting, the profile is fitted as a polynomial in the
            # length too (runs at two more lengths, checked exactly at a fourth); then every
            # length is numpy. Where memory is no such polynomial, the length is profiled as
            # the example was, at that length (cached): exact either way.
            base = self._profiled_timeline(precision, mode, None, levers)  # fails as it fails
            key = (precision, mode, levers)
            if key not in self._across_lengths:
                self._across_lengths[key] = self._source.timeline_across_lengths(
                    precision, mode, base, levers
                )
            polynomial = self._across_lengths[key]
            if polynomial is not None and self._same_side_of_window(seq_len):
                return polynomial
            length_key = (*key, seq_len)
            if length_key not in self._other_lengths:
                self._other_lengths[length_key] = self._source.timeline(
                    precision, mode, seq_len, levers
                )
            return self._other_lengths[length_key]
        key = (precision, mode, levers)
        if key not in self._timelines and key not in self._failures:
            try:
                self._timelines[key] = self._source.timeline(precision, mode, None, levers)
            except ProfilingError as exc:
                self._failures[key] = exc
        failure = self._failures.get(key)
        if failure is not None:
            others = [p.value for p, m, lv in self._timelines if m is mode and lv == levers]
            if not others:  # no precision runs: the model's own failure, as it came
                raise failure
            raise ProfilingError(
                f"{mode.value} in {precision.value} cannot run for device={self.device.value!r} "
                f"({', '.join(others)} can): {failure}"
            ) from failure.__cause__
        return self._timelines[key]

    @property
    def precisions(self: ModelProfile) -> tuple[Precision, ...]:  # type: ignore[misc]
        """The precisions profiled so far whose training step runs (the widget starts there
        when fp32 does not: a kernel that runs in some dtypes only). Where no training step
        has been profiled yet (``profile_model`` defers its runs), fp32's is profiled now,
        then bf16's and fp16's while it fails; where none runs, fp32's error is raised."""
        if not any(m is Mode.TRAIN and lv == NO_LEVERS for _p, m, lv in self._timelines):
            first: ProfilingError | None = None
            for precision in (Precision.FP32, Precision.BF16, Precision.FP16):
                try:
                    self.timeline(precision, Mode.TRAIN)
                    break
                except ProfilingError as exc:
                    first = first or exc
            else:
                assert first is not None
                raise first
        return tuple(p for p, m, lv in self._timelines if m is Mode.TRAIN and lv == NO_LEVERS)

    def optimizer_trace(  # type: ignore[misc]
        self: ModelProfile,
        precision: Precision,
        optimizer: OptimizerChoice,
        levers: Levers = NO_LEVERS,
        only: tuple[str, ...] | None = None,
        shard: tuple[int, int] | None = None,
        implementation: OptimizerImplementation | None = None,
    ) -> OptimizerTrace:
        """The optimizer's step (``only``: over these parameters alone, a ZeRO shard;
        ``shard=(world_size, rank)``: over that rank's FSDP2 shard of each parameter),
        run as ``implementation`` (None: torch's default on the profile's device)."""
        impl = implementation or default_implementation(self.device)
        key = (precision, optimizer, _optimizer_levers(levers), only, shard, impl)
        if key not in self._optimizers:
            # the training step of these levers first: it says which parameters got a
            # gradient (the optimizer's state is made for those)
            self.timeline(precision, Mode.TRAIN, None, levers)
            self._optimizers[key] = self._source.optimizer_trace(
                precision, optimizer, _profiled(levers, Mode.TRAIN), only, shard, impl
            )
        return self._optimizers[key]
