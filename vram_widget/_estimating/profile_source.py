"""What a profile asks its source (the profiler) for, and the error a model that cannot be
profiled raises. No torch here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from .estimator import MemoryEstimate
from .levers import Levers
from .loading import LoadLayout
from .options import (
    Mode,
    OptimizerChoice,
    OptimizerImplementation,
    Precision,
)
from .recipe import Recipe
from .recipe.float8 import Float8
from .recipe.pipeline import StageQuestion
from .recipe.weights import Weights
from .sharding import Parallel
from .table import OptimizerTrace, Timeline

if TYPE_CHECKING:
    from .profile import ModelProfile


class ProfilingError(RuntimeError):
    """The model could not be run on the example inputs (the message says where and why)."""


class ProfileSource(Protocol):
    """What the profile asks its profiler for, once per key."""

    def timeline(
        self, precision: Precision, mode: Mode, seq_len: int | None = None, levers: Levers = ...
    ) -> Timeline: ...

    def timeline_across_lengths(
        self, precision: Precision, mode: Mode, base: Timeline, levers: Levers = ...
    ) -> Timeline | None: ...

    def optimizer_trace(
        self,
        precision: Precision,
        optimizer: OptimizerChoice,
        levers: Levers = ...,
        only: tuple[str, ...] | None = ...,
        shard: tuple[int, int] | None = ...,
        implementation: OptimizerImplementation = ...,
    ) -> OptimizerTrace: ...

    def lora_profile(
        self, rank: int, targets: tuple[str, ...] | None, dtype: str | None = None
    ) -> ModelProfile: ...

    def quantized_profile(
        self,
        weights: Weights,
        rank: int | None = None,
        targets: tuple[str, ...] | None = None,
        dtype: str | None = None,
    ) -> ModelProfile: ...

    def float8_profile(self, float8: Float8) -> ModelProfile: ...
    def tensor_parallel_estimate(
        self, tp: int, tp_plan: object, recipe: Recipe
    ) -> MemoryEstimate: ...

    def tensor_parallel_cached(self, tp: int, tp_plan: object, recipe: Recipe) -> bool: ...

    def expert_parallel_estimate(self, ep: int, recipe: Recipe) -> MemoryEstimate: ...
    def expert_parallel_refusal(self, ep: int) -> str | None: ...
    def context_parallel_estimate(
        self, cp: int, seq_len: int, recipe: Recipe
    ) -> MemoryEstimate: ...

    def tensor_parallel_refusal(self, tp: int) -> str | None: ...
    def context_parallel_refusal(self) -> str | None: ...
    def pipeline_parallel_refusal(
        self, pp: int, stages_per_rank: int = ..., tp: int = ...
    ) -> str | None: ...
    def pipeline_stage_peaks(self, question: StageQuestion) -> tuple[Any, ...]: ...
    def float8_fsdp_step(
        self,
        float8: Float8,
        parallel: Parallel,
        batch_size: int,
        seq_len: int | None,
        precision: Precision,
        optimizer: OptimizerChoice | None,
        implementation: OptimizerImplementation | None,
        rank: int = 0,
    ) -> Any: ...
    def float8_fsdp_cached(
        self,
        float8: Float8,
        parallel: Parallel,
        batch_size: int,
        seq_len: int | None,
        precision: Precision,
        optimizer: OptimizerChoice | None,
        implementation: OptimizerImplementation | None,
        rank: int = 0,
    ) -> bool: ...

    def generation(
        self,
        precision: Precision,
        seq_len: int | None,
        *,
        decode_steps: int = ...,
        new_tokens: int | None = ...,
    ) -> Timeline: ...

    def kv_cache_profile(self, cache_config: dict[str, object]) -> ModelProfile: ...

    def load_layout(self, dtype: str, weights: Weights) -> LoadLayout: ...
