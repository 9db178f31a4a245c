"""What ``measure`` returns: the measured memory of one real step."""

from __future__ import annotations

import dataclasses
from typing import Any

from .._estimating.compiled import CompileScope
from .._estimating.options import (
    Mode,
    OptimizerChoice,
    Precision,
    Strategy,
)


@dataclasses.dataclass(frozen=True)
class Measurement:
    """The measured memory of one steady-state training step or inference pass.

    Attributes
    ----------
    peak_bytes
        The peak of live tensor bytes during the measured (second) iteration, including what
        was resident at its start.
    resident_bytes
        What was live at the start of the measured iteration. CPU: the unique storages of the
        model copy's parameters and buffers, the optimizer state and the input batch. CUDA:
        ``torch.cuda.memory_allocated()`` then, less its value before ``measure`` made copies
        (so allocator rounding and anything else ``measure`` left alive is included).
    device
        ``"cpu"`` or ``"cuda"``.
    precision, optimizer, mode
        The settings measured (``optimizer`` is None for inference, or when the model has no
        trainable parameter).
    batch_size
        Dim 0 of the input batch.
    max_reserved_bytes
        CUDA only (None on CPU): ``torch.cuda.max_memory_reserved()`` during the measured
        iteration. This is process-wide (it includes what the caching allocator held
        before ``measure``), since cached blocks cannot be attributed to one caller.
    """

    peak_bytes: int
    resident_bytes: int
    device: str
    precision: Precision
    optimizer: OptimizerChoice | None
    mode: Mode
    batch_size: int
    max_reserved_bytes: int | None = None
    # with gpus > 1: the ranks, their strategy, and each rank's peak (this is the highest)
    gpus: int = 1
    strategy: Strategy | None = None
    rank_peak_bytes: tuple[int, ...] = ()
    # tensor-parallel ranks among ``gpus`` (1: none; strategy is None then)
    tp: int = 1
    ep: int = 1
    # pipeline stages among ``gpus`` (1: none), one a rank: rank_peak_bytes in stage order
    pp: int = 1
    # mode="generate": the new tokens generated after the prompt
    new_tokens: int | None = None
    # with snapshot=True on CUDA: torch.cuda.memory._snapshot() recorded over the measured
    # iteration (compare with MemoryEstimate.compare_snapshot)
    snapshot: dict[str, Any] | None = dataclasses.field(default=None, repr=False, compare=False)
    # the step as torch.compile runs it (None: eager), and the partitioner's budget
    compile: CompileScope | None = None
    activation_memory_budget: float | None = None
    # mode="train", one process, CPU: the bytes alive when the model's (first) forward of the
    # measured iteration returns less those alive when it was called, less its outputs'
    # storages: what the forward leaves for the backward (autograd's saved tensors; under
    # torch.compile the forward graph's saved values)
    saved_bytes: int | None = None

    @property
    def transient_bytes(self) -> int:
        """``peak_bytes - resident_bytes``: what the step itself adds at its peak."""
        return self.peak_bytes - self.resident_bytes
