"""The estimator: plain arithmetic over the profile table (numpy; no torch, no widgets).

Given the fitted timeline of a step, a batch size and an optimizer's cached step trace, it
lays the step's events end to end on top of what is resident and reads off the peak.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from .accelerator import (
    AcceleratorExtras,
    CudaContext,
    NcclBuffers,
    cublas_workspace_bytes,
    cuda_block_bytes,
    cuda_context,
    nccl_buffers,
)
from .allocator import (
    K_ROUND_LARGE,
    AllocatorReplay,
    OutOfMemory,
    align_allocations,
    replay,
)
from .communication import CollectiveKind
from .decoding import Generation, Recording, StepEvents, step_of, unroll
from .gpus import Gpu, parse_capacity
from .levers import NO_LEVERS, Levers
from .options import (
    CATEGORIES,
    CATEGORY_CODE,
    PHASE_CODE,
    PHASES,
    Category,
    Device,
    FitBasis,
    Mode,
    OptimizerChoice,
    Phase,
    Precision,
    Strategy,
    parse_option,
)
from .replaying import ReplayStream, cached_replay
from .sharding import SINGLE_DEVICE, STRATEGIES, Parallel, StepEdits
from .table import N_CATEGORIES, ModuleRows, OptimizerTrace, Timeline, sum_by

if TYPE_CHECKING:
    import pandas as pd

# The GPU the CUDA extras are for unless the caller names one: an H100 (compute capability
# 9.0), whose cuBLAS workspace is the largest (32 MiB), so the default does not under-count.
DEFAULT_COMPUTE_CAPABILITY = (9, 0)

_TEMPORARY = CATEGORY_CODE[Category.TEMPORARY]


@dataclass(frozen=True, eq=False)
class LayerTable:
    """Per-row arrays (one row per module, then the loss and optimizer pseudo-rows)."""

    name: tuple[str, ...]
    type: tuple[str, ...]
    depth: np.ndarray
    output_dims: np.ndarray  # (rows x max_ndim), padded with 1
    output_ndim: np.ndarray  # -1 for a row with no tensor output
    output_numel: np.ndarray
    param_count: np.ndarray
    param_bytes: np.ndarray
    buffer_bytes: np.ndarray
    gradient_bytes: np.ndarray
    optimizer_state_bytes: np.ndarray
    activation_bytes: np.ndarray
    flops_forward: np.ndarray
    flops_backward: np.ndarray

    @cached_property
    def output_shape(self) -> tuple[tuple[int, ...] | None, ...]:
        """Each row's output shape (None where the row returns no tensor); built on first
        access, once (callers index it row by row)."""
        return tuple(
            None if n < 0 else tuple(int(d) for d in dims[:n])
            for dims, n in zip(self.output_dims, self.output_ndim, strict=True)
        )

    def to_dataframe(self) -> pd.DataFrame:
        import pandas as pd

        return pd.DataFrame(
            {
                "name": list(self.name),
                "type": list(self.type),
                "depth": self.depth,
                "output_shape": list(self.output_shape),
                "output_numel": self.output_numel,
                "param_count": self.param_count,
                "param_bytes": self.param_bytes,
                "buffer_bytes": self.buffer_bytes,
                "gradient_bytes": self.gradient_bytes,
                "optimizer_state_bytes": self.optimizer_state_bytes,
                "activation_bytes": self.activation_bytes,
                "flops_forward": self.flops_forward,
                "flops_backward": self.flops_backward,
            }
        )


@dataclass(frozen=True, eq=False)
class MemoryEstimate:
    """The memory and FLOPs of one step at one setting.

    ``peak_bytes`` is live tensor bytes at the step's peak (what
    ``torch.cuda.max_memory_allocated()`` reports on CUDA, less the allocator's rounding,
    which is in ``extras``). The category fields are totals over the step;
    ``peak_breakdown`` says what was live at the peak.
    """

    batch_size: int
    precision: Precision
    optimizer: OptimizerChoice | None
    mode: Mode
    device: Device
    seq_len: int | None  # tokens per sample (None: the profile has no sequence axis)
    peak_bytes: int
    peak_phase: Phase
    peak_module: str
    peak_op: str
    parameter_bytes: int
    buffer_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    activation_bytes: int
    input_bytes: int
    communication_bytes: int  # a data-parallel strategy's resident buffers (DDP's buckets)
    peak_breakdown: Mapping[Category, int]
    flops_forward: int
    flops_backward: int
    extras: AcceleratorExtras
    exact: bool  # every event verified at a held-out batch size (False: extrapolated)
    layers: LayerTable
    live_bytes: np.ndarray = field(repr=False)  # after each event of the step
    event_module: np.ndarray = field(repr=False)  # row of each event
    event_phase: np.ndarray = field(repr=False)  # phase code of each event
    # category code of each event's storage (a generation's KV cache among them)
    event_category: np.ndarray | None = field(default=None, repr=False)
    # the memory levers the step was estimated with (checkpointing, frozen subset, accumulation)
    levers: Levers = NO_LEVERS
    # for the allocator replay: each event's storage (None: not recorded) and the sizes of
    # the storages resident before the step (parameters, buffers, optimizer state, inputs)
    event_storage: np.ndarray | None = field(default=None, repr=False)
    event_bytes: np.ndarray | None = field(default=None, repr=False)  # signed, per event
    resident_storage_bytes: np.ndarray | None = field(default=None, repr=False)
    # the caching allocator's setting the reserved and device figures are for
    expandable_segments: bool = False
    # data-parallel ranks the step is one of (1: one device), and their strategy (None: 1)
    gpus: int = 1
    strategy: Strategy | None = None
    # the rank estimated where ranks differ (ZeRO's shards): the worst one; None where not
    rank: int | None = None
    # tensor-parallel ranks among ``gpus`` (1: none): the estimate is one rank's, sharded
    tp: int = 1
    # expert-parallel ranks (1: none): the estimate is one rank's, its experts sharded and
    # the tokens routed evenly (each rank's experts receive tokens * top_k / ep pairs);
    # ep_worst_case_bytes is the same rank's peak where every token's picks go to its
    # experts (as many as it holds): a bound for a skewed router, not reached exactly (the
    # real all-to-one rank of a small Mixtral, fp32 Adam: 4,919,740 B under 5,031,340 B,
    # tests/test_expert_parallel.py); None where ep = 1
    ep: int = 1
    ep_worst_case_bytes: int | None = None
    # pipeline ranks among ``gpus`` (1: none), the schedule, its micro-batches and the
    # stages a rank holds (several with "interleaved-1f1b"); with pp > 1, peak_bytes and
    # parameter_bytes are the worst rank's, each rank's peak and resident bytes
    # (parameters, optimizer state, batch, receive buffers; all its stages') in rank order
    pp: int = 1
    pp_schedule: str | None = None
    microbatches: int | None = None
    stage_peak_bytes: tuple[int, ...] = ()
    stage_resident_bytes: tuple[int, ...] = ()
    stages_per_rank: int = 1
    # the bytes the rank sends per step (communication.py: ring counts of each collective
    # it issues), recorded from its step on the fake process group with tp, ep or pp > 1
    # (with pp, the stage that sends most); and the same by collective kind. None and {}
    # where not estimated (one device, data-parallel strategies: LayoutPlan's rows have
    # theirs)
    communication_sent_bytes: int | None = None
    communication_sent_bytes_by_kind: Mapping[CollectiveKind, int] = field(default_factory=dict)
    # context-parallel ranks (1: none): the estimate is one rank's (rank 0), its step at
    # seq_len / cp tokens with torch's ring attention (seq_len stays the whole sequence's);
    # UNCONFIRMED against a real CUDA run (docs/known-gaps.md)
    cp: int = 1
    # NCCL's own buffers on the rank (CUDA, more than one GPU): outside the allocator, so
    # in no total here; shown beside them with the defaults they assume
    nccl: NcclBuffers | None = None
    # mode="generate": the new tokens and the KV cache (``decoding.Generation``), and the
    # step the peak falls in (0: the prompt's prefill, k: decode step k)
    generation: Generation | None = None
    peak_step: int | None = None
    # how torch.optim ran the optimizer's step ("fused", "foreach" or "forloop"; None: no
    # optimizer step): the one asked, else torch's default on the device
    optimizer_implementation: str | None = None
    # settings of the config the Recipe was read from that change memory but are not
    # estimated (``Recipe.ignored``: ``Recipe.from_training_arguments``, ``from_torchtune``)
    ignored: tuple[str, ...] = ()
    # bitsandbytes' paged optimizer state (``optimizer="paged-adamw8bit"``, device="cuda"):
    # the state of each parameter of at least 1e5 elements lives in CUDA unified memory
    # (cudaMallocManaged, outside PyTorch's caching allocator), which the driver pages
    # between host and device on demand; so it is in no total here (not in
    # max_memory_allocated), and is what the device may hold besides them
    paged_bytes: int = 0
    # activation offloading (``offload_activations``, ``offloading.py``): the host memory
    # the offloaded copies of saved tensors take at their peak (pinned by torchtune's
    # OffloadActivations); in no device total here
    host_bytes: int = 0
    # how the base weights are stored where bitsandbytes quantized them
    # (``Weights.describe()``); "" in the precision's dtype
    weights: str = ""
    # torchao's float8 training of the Linear layers (``Float8.describe()``); "" off
    float8: str = ""
    # torch.compile: why a compiled graph's temporaries are its ATen ops run one at a time
    # instead of Inductor's generated code, one line each (``compile_bound``); () where
    # every graph ran as Inductor's code
    compile_fallbacks: tuple[str, ...] = ()

    @property
    def compile_bound(self) -> bool:
        """True for a ``torch.compile`` step (``levers.compile``) where a compiled graph
        could not run as Inductor's generated code (``compile_fallbacks`` says why): its
        temporaries are then those of its ATen ops run one at a time, an upper bound on
        what Inductor's fused kernels and reused buffers allocate. False where every graph
        ran as Inductor's code for the CPU (its allocations, frees and buffer reuse on fake
        tensors): the saved set and the region temporaries are the compiled CPU step's
        (the guide on torch.compile; on ``device="cuda"`` that plan is unconfirmed against
        Triton's code).

        Examples
        --------
        >>> from vram_widget import profile_model, zoo
        >>> profile = profile_model(zoo.mlp(), input_size=(784,), device="cpu")
        >>> profile.estimate(4, optimizer="sgd").compile_bound
        False
        """
        return self.levers.compile is not None and bool(self.compile_fallbacks)

    @property
    def saved_bytes(self) -> int | None:
        """The bytes saved for the backward that are alive when the (first micro-batch's)
        forward and loss end: the activations autograd keeps (eager), or the
        partitioner's saved set (``compile``), outputs of the model that are also saved
        included. None outside training or where the estimate has no per-event categories.

        Examples
        --------
        >>> import torch
        >>> from vram_widget import profile_model
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
        ...                             torch.nn.Linear(16, 4))
        >>> profile = profile_model(model, input_size=(8,), device="cpu", cache=False)
        >>> profile.estimate(2, optimizer="sgd").saved_bytes  # tanh's output: 2 x 16 x 4 B
        128
        """
        cats, deltas = self.event_category, self.event_bytes
        if self.mode is not Mode.TRAIN or cats is None or deltas is None:
            return None
        later = np.flatnonzero(self.event_phase != PHASE_CODE[Phase.FORWARD])
        end = int(later[0]) if len(later) else len(self.event_phase)
        saved = np.asarray(cats[:end]) == CATEGORY_CODE[Category.ACTIVATION]
        return int(sum(int(b) for b in np.asarray(deltas[:end], dtype=object)[saved]))

    @property
    def new_tokens(self) -> int | None:
        """The tokens generated after the prompt (``mode="generate"``; else None)."""
        return None if self.generation is None else self.generation.new_tokens

    @property
    def kv_cache_bytes(self) -> int | None:
        """The KV cache after the last decode step (``mode="generate"``; else None)."""
        return None if self.generation is None else self.generation.kv_cache_bytes

    @property
    def kv_cache_bytes_per_token(self) -> int | None:
        """What one more token of context adds to the KV cache, per sequence, at the end of
        the generation (``mode="generate"``; else None): 0 past a sliding window, and for a
        cache allocated whole before the first step (``StaticCache``)."""
        return None if self.generation is None else self.generation.kv_cache_bytes_per_token

    @cached_property
    def allocator(self) -> AllocatorReplay | None:
        """The step replayed through the CUDA caching allocator's rules (``allocator``):
        residents first, then the step twice, the peaks of the second (steady-state)
        iteration, with the estimate's ``expandable_segments`` setting. None for
        ``device="cpu"`` (no caching allocator) or an estimate made without storage ids."""
        return self.replayed(expandable_segments=self.expandable_segments)

    def replayed(
        self,
        expandable_segments: bool = False,
        capacity_bytes: int | None = None,
        frames: list[list[dict[str, Any]]] | None = None,
    ) -> AllocatorReplay | None:
        """:attr:`allocator`, or the same replay with ``expandable_segments:True`` (one
        growing segment per pool, ``allocator.ExpandableAllocator``), or under a cap on
        what the allocator may reserve (raises ``allocator.OutOfMemory`` where the step
        does not fit it). The cuBLAS workspace of the extras goes through the allocator as
        well (CublasHandlePool.cpp allocates it with the caching allocator), resident from
        the first matmul on. ``frames`` (one list per event) records the replay as a
        snapshot (:meth:`memory_snapshot`)."""
        stream = self._replay_stream
        if stream is None:
            return None
        if frames is not None:  # the reference allocator, which records the trace
            return replay(
                stream.resident_bytes.tolist(),
                zip(stream.storage.tolist(), stream.nbytes.tolist(), strict=True),
                expandable_segments=expandable_segments,
                capacity_bytes=capacity_bytes,
                frames=frames,
                record=True,
            )
        # the free replay keeps its state where the first cap device_bytes tries would bind,
        # so that the capped replays of the climb start there (replaying.fast_replay)
        mark = None
        if capacity_bytes is None and not expandable_segments:
            mark = self._device_floor - self.extras.cuda_context_bytes
        return cached_replay(
            stream,
            capacity_bytes=capacity_bytes,
            expandable_segments=expandable_segments,
            checkpoint_above=mark,
        )

    @cached_property
    def _replay_stream(self) -> ReplayStream | None:
        """What the allocator replays: the residents, the cuBLAS workspace after them, and
        the step's events; None where nothing is replayed (``device="cpu"``, no storage
        ids). Replays of the same stream and setting run once in the process
        (``replaying.cached_replay``), whichever estimate asks."""
        if self.device is not Device.CUDA or self.event_storage is None:
            return None
        assert self.resident_storage_bytes is not None and self.event_bytes is not None
        residents = self.resident_storage_bytes
        count = self.extras.cublas_workspace_count
        if count:  # each workspace an allocation of its own
            each = self.extras.cublas_workspace_bytes // count
            residents = np.append(residents, np.full(count, each, dtype=np.int64))
        return ReplayStream.of(residents, self.event_storage, self.event_bytes)

    def memory_snapshot(self, expandable_segments: bool | None = None) -> dict[str, Any] | None:
        """The predicted step in the format of ``torch.cuda.memory._snapshot()``: the
        replayed allocator's segments and blocks at the end, and its trace (segment
        allocations, allocations and frees of the residents and of two iterations of the
        step), each request framed by the module that made it and the phase
        (``{"filename": "layer1.0.conv1 (Conv2d)", "line": 0, "name": "forward"}``). Open it
        in PyTorch's memory viewer (https://pytorch.org/memory_viz, or
        ``torch.cuda._memory_viz.trace_plot``) beside a snapshot of a real run. None for
        ``device="cpu"``.

        Examples
        --------
        >>> import torch
        >>> from vram_widget import profile_model
        >>> est = profile_model(torch.nn.Linear(1024, 1024), input_size=(1024,)).estimate(1)
        >>> snap = est.memory_snapshot()
        >>> # MiB: the weight's, the small tensors', and the two cuBLAS workspaces of a
        >>> # training step (the forward thread's and autograd's)
        >>> [s["total_size"] >> 20 for s in snap["segments"]]
        [20, 2, 32, 32]
        """
        if self.device is not Device.CUDA or self.event_storage is None:
            return None
        assert self.resident_storage_bytes is not None and self.event_bytes is not None
        if expandable_segments is None:
            expandable_segments = self.expandable_segments
        names, types = self.layers.name, self.layers.type
        labels = [f"{n or '(model)'} ({t})" if t else n for n, t in zip(names, types, strict=True)]
        frames = [
            [{"filename": labels[int(row)], "line": 0, "name": PHASES[int(phase)].value}]
            for row, phase in zip(self.event_module, self.event_phase, strict=True)
        ]
        replayed = self.replayed(expandable_segments, frames=frames)
        return None if replayed is None else replayed.snapshot

    def save_memory_snapshot(self, path: str, expandable_segments: bool | None = None) -> None:
        """Pickle :meth:`memory_snapshot` to ``path``, as
        ``torch.cuda.memory._dump_snapshot`` writes a real one."""
        snapshot = self.memory_snapshot(expandable_segments)
        if snapshot is None:
            raise ValueError(
                "a memory snapshot is the CUDA caching allocator's: this estimate is for "
                'device="cpu"; profile with device="cuda"'
            )
        with open(path, "wb") as f:
            pickle.dump(snapshot, f)

    def compare_snapshot(self, measured: Mapping[str, Any]) -> pd.DataFrame:
        """Where a real step's allocations differ from this prediction, per module and phase.

        ``measured`` is a ``torch.cuda.memory._snapshot()`` recorded around one steady-state
        step of the same model and setting (``measure(..., snapshot=True).snapshot`` on a
        GPU). The allocations are paired in order with those of the predicted step
        (``allocator.align_allocations``) and summed per module and phase: columns
        ``module``, ``phase``, ``predicted_bytes``, ``measured_bytes``,
        ``difference_bytes`` (measured minus predicted), largest differences first;
        ``df.attrs["note"]`` says where the allocation counts differ.
        """
        import pandas as pd

        predicted = self.memory_snapshot()
        if predicted is None:
            raise ValueError(
                "a snapshot comparison is the CUDA caching allocator's: this estimate is for "
                'device="cpu"; profile with device="cuda"'
            )
        pairs, note = align_allocations(predicted, measured)
        frame = pd.DataFrame(
            [(p.module, p.phase, p.predicted_bytes, p.measured_bytes) for p in pairs],
            columns=["module", "phase", "predicted_bytes", "measured_bytes"],
        )
        table = frame.groupby(["module", "phase"], sort=False, as_index=False).sum()
        table["difference_bytes"] = table["measured_bytes"] - table["predicted_bytes"]
        table = table.sort_values(
            "difference_bytes", key=lambda d: d.abs(), ascending=False, kind="stable"
        ).reset_index(drop=True)
        table.attrs["note"] = note
        return table

    def fits_device(self, capacity_bytes: int | str | Gpu) -> bool | None:
        """Whether the step runs on a device of ``capacity_bytes`` without a CUDA
        out-of-memory error: exactly ``device_bytes <= capacity`` (see :attr:`device_bytes`).
        None for ``device="cpu"``.

        ``capacity_bytes`` takes every form of :func:`~vram_widget._estimating.gpus.
        resolve_gpu`: bytes (an int of at least 1 MiB), ``"80GiB"``, ``"80G"``, ``"80GB"``
        (10**9), a GPU name."""
        capacity = parse_capacity(capacity_bytes)
        bounds = self._device_bounds()
        if bounds is None:
            return None
        least, most = bounds
        if capacity < least or capacity >= most:  # no replay needed: device_bytes is between
            return capacity >= most
        device = self.device_bytes
        assert device is not None
        return device <= capacity

    def _device_bounds(self) -> tuple[int, int] | None:
        """The least and the most :attr:`device_bytes` can be, without a replay under a cap."""
        free = self.allocator
        if free is None:
            return None
        context = self.extras.cuda_context_bytes
        if self.expandable_segments:
            return (free.peak_reserved_bytes + context,) * 2
        step = K_ROUND_LARGE
        most = -(-free.peak_reserved_bytes // step) * step + context
        return min(self._device_floor, most), most

    @cached_property
    def _device_floor(self) -> int:
        """The peak of 512-byte blocks and the cuBLAS workspace, up to a 2 MiB step, plus
        the CUDA context: below it no allocator runs the step (a bound of
        :attr:`device_bytes` known without a replay)."""
        step = K_ROUND_LARGE
        rounded = self.peak_bytes + self.extras.allocator_rounding_bytes
        least = -(-(rounded + self.extras.cublas_workspace_bytes) // step)
        return least * step + self.extras.cuda_context_bytes

    @cached_property
    def device_bytes(self) -> int | None:
        """The device memory the step needs on ``device="cuda"``, the number a CUDA card's
        capacity is compared with: ``fits(c)`` is ``device_bytes <= c``, exactly. None for
        ``device="cpu"``, where the number compared is :attr:`total_bytes`.

        It is the least capacity, in 2 MiB steps above the CUDA context, under which the
        caching allocator, replayed with that capacity less the context, runs the step,
        releasing its cached segments as it does before an out-of-memory error (every
        lower step tried fails); plus the CUDA context outside the allocator. At most the
        unconstrained reserved peak plus the context. With ``expandable_segments``: the
        pages mapped at the peak plus the context (pages are unmapped only on an
        out-of-memory error, which is not replayed: an upper bound)."""
        bounds = self._device_bounds()
        if bounds is None:
            return None
        least, most = bounds
        if least == most:  # expandable segments, or nothing cached that could be released
            return most
        step, context = K_ROUND_LARGE, self.extras.cuda_context_bytes
        # In 2 MiB units, climbing from a lower bound: below the peak of 512-byte blocks the
        # step cannot run whatever the allocator does. A cap that fails says by how much the
        # segment it could not reserve was over it (after the allocator released what it
        # could); the next cap is that much higher, as no smaller raise gets past that
        # request. The first cap that runs is the answer, every lower one tried having
        # failed; at the unconstrained reserved peak nothing has to be released, so the
        # climb stops there at the latest. A failing replay stops at its failure, so this
        # costs about half a bisection between the two bounds (measured: 2-11 replays), each
        # remembered per step and capacity (replaying.cached_replay): another estimate of
        # the same setting, made by any caller, climbs again without a replay. Each capped
        # replay starts where the free replay would first pass its cap (the free replay
        # keeps its state where it passes the least cap tried, ``replayed``; each capped
        # one where it binds): the climb costs about 2 plain replays' time, not one
        # replay per cap (benchmarks/speed.py).
        cap, top = (least - context) // step, (most - context) // step
        while cap < top:
            try:
                self.replayed(capacity_bytes=cap * step)
            except OutOfMemory as short:
                over = short.reserved + short.segment - cap * step
                cap += max(1, -(-over // step))
            else:
                break
        return min(cap, top) * step + context

    @property
    def allocated_bytes(self) -> int | None:
        """What ``torch.cuda.max_memory_allocated()`` reports for a steady-state step above
        the cuBLAS workspace, on ``device="cuda"``: the replayed caching allocator's
        (``allocator``) peak of the blocks in use, each charged in full. ``peak_bytes``
        counts the tensors' own bytes; the allocator charges a whole block where it does
        not split one, which it does not where the remainder would be 1 MiB or less
        (``kSmallSize``, c10/cuda/CUDACachingAllocator.cpp), and rounds each request up to
        512 bytes. None for ``device="cpu"``, where ``peak_bytes`` is the allocator's count.
        """
        replayed = self.allocator
        if replayed is None:
            return None
        return replayed.peak_allocated_bytes - self.extras.cublas_workspace_bytes

    @property
    def reserved_bytes(self) -> int | None:
        """What ``torch.cuda.max_memory_reserved()`` would report for a steady-state step:
        the caching allocator's segments at their peak (``allocator``); None for
        ``device="cpu"``. Not yet checked on a GPU."""
        replayed = self.allocator
        return None if replayed is None else replayed.peak_reserved_bytes

    @property
    def peak_location(self) -> str:
        """Where the peak is, as a person reads it: the module, the op or autograd node
        running in the module's own code where that is not a leaf module's (a root's loss,
        an attention block's math), and the phase, e.g. ``"GPT2LMHeadModel: NllLossBackward0,
        backward"`` or ``"features.28, forward"``; in a generation, the step: ``"lm_head,
        decode step 63"``."""
        where = f"{self.peak_module}: {self.peak_op}" if self.peak_op else self.peak_module
        if self.peak_step is not None and self.peak_step > 0:
            return f"{where}, decode step {self.peak_step}"
        return f"{where}, {self.peak_phase.value}"

    @property
    def flops(self) -> int:
        """FLOPs of the step (forward + backward in training), 2 per multiply-add."""
        return self.flops_forward + self.flops_backward

    @property
    def macs(self) -> int:
        """Multiply-accumulates of the step (FLOPs / 2), as thop and torchinfo count."""
        return self.flops // 2

    @property
    def total_bytes(self) -> int:
        """``peak_bytes`` plus the accelerator extras (CUDA context, cuBLAS workspace,
        512-byte rounding): the number a device's capacity is compared with on
        ``device="cpu"`` (``fits(c)`` is ``total_bytes <= c``), and on ``device="cuda"``
        with ``fits(c, basis="allocated")``. On ``device="cuda"`` the default comparison is
        with :attr:`device_bytes`."""
        return self.peak_bytes + self.extras.total_bytes

    def fits(
        self, capacity_bytes: int | str | Gpu, basis: str | FitBasis = FitBasis.DEVICE
    ) -> bool:
        """Whether the step fits a device of ``capacity_bytes``.

        The number compared with the capacity: on ``device="cuda"``, :attr:`device_bytes`
        (``fits(c)`` is ``device_bytes <= c``: the allocator replayed under the capacity less
        the CUDA context, what an out-of-memory error decides on); on ``device="cpu"``, and
        with ``basis="allocated"``, :attr:`total_bytes` (``total_bytes <= c``).

        Parameters
        ----------
        capacity_bytes : int, str or Gpu
            Bytes (an int of at least 1 MiB), a string with a unit (``"80GiB"``, ``"80G"``:
            ``80 * 2**30``; ``"80GB"``: ``80 * 10**9``) or a GPU name (``"A100 80GB"``,
            ``"H100"``): every form :func:`~vram_widget._estimating.gpus.resolve_gpu` takes,
            the same in every function that takes a capacity.
        basis : {"device", "allocated"}
            ``"device"`` (default) or ``"allocated"``, as above.

        Raises
        ------
        ValueError
            For a capacity in no valid form (a bare number below 1 MiB, a float, an unknown
            or ambiguous GPU name), naming the valid forms.

        Examples
        --------
        >>> import torch
        >>> from vram_widget import profile_model
        >>> est = profile_model(torch.nn.Linear(1024, 1024), input_size=(1024,)).estimate(1)
        >>> est.fits(est.device_bytes), est.fits(est.device_bytes - 1)
        (True, False)
        >>> est.fits("80G") == est.fits("80GiB") == est.fits(80 * 2**30)
        True
        """
        capacity = parse_capacity(capacity_bytes)
        if parse_option(FitBasis, basis, "basis") is FitBasis.DEVICE:
            device = self.fits_device(capacity)
            if device is not None:
                return device
        return self.total_bytes <= capacity

    def to_dataframe(self) -> pd.DataFrame:
        """One row per module (and the loss and optimizer pseudo-rows); rows sum to totals."""
        return self.layers.to_dataframe()


def _as_int(x: Any) -> int:
    return int(x)


def estimate(
    rows: ModuleRows,
    timeline: Timeline,
    opt: OptimizerTrace | None,
    *,
    batch_size: int,
    precision: Precision,
    optimizer: OptimizerChoice | None,
    mode: Mode,
    device: Device,
    seq_len: int | None = None,
    compute_capability: tuple[int, int] = DEFAULT_COMPUTE_CAPABILITY,
    levers: Levers = NO_LEVERS,
    expandable_segments: bool = False,
    parallel: Parallel = SINGLE_DEVICE,
    communication_blocks: Sequence[int] = (),
    rank: int | None = None,
    edits: StepEdits | None = None,
    new_tokens: int | None = None,
    across_window: tuple[Timeline, int] | None = None,
    optimizer_implementation: str | None = None,
    context: CudaContext | None = None,
) -> MemoryEstimate:
    """Lay the step's events on top of what is resident and read off the peak.
    ``compute_capability`` is the target GPU's, for the CUDA extras (cuBLAS workspace, and
    the CUDA context unless ``context`` gives it: ``accelerator.cuda_context``);
    ``communication_blocks`` are the buffers ``parallel``'s strategy keeps resident on each
    rank (``sharding``), allocated before the step as the parameters are; ``rank`` is the
    rank whose optimizer shard ``opt`` is, where ranks differ. ``edits`` are what a strategy
    that shards the parameters (FSDP2) inserts into the step, with the shards it keeps
    instead of whole parameters and gradients (``sharding.fsdp_step_edits``).
    ``new_tokens``: generation (``mode="generate"``), the recorded prefill and decode steps
    unrolled to that many new tokens (``decoding.unroll``); ``across_window``: a generation
    recorded across the model's sliding window, and its prompt's length, where the steps
    cross it."""
    if batch_size == 1 and timeline.batch_one is not None:
        timeline = timeline.batch_one  # the step at batch 1 as profiled there
    n_rows = len(rows.names)
    op_names = timeline.op_names
    train = mode is Mode.TRAIN
    length = seq_len or 1  # a timeline of one length has no seq terms: any value serves
    seq = timeline.events_at(batch_size, length)
    modules = timeline.event_module
    phases = timeline.event_phase
    cats = timeline.event_category
    ops = timeline.event_op
    resident = timeline.resident_by_category(batch_size, length)
    storage = timeline.event_storage
    resident_blocks = np.asarray(
        timeline.storage_bytes.at(batch_size, length)[timeline.storage_resident], dtype=object
    )
    k = timeline.optimizer_at
    n_storages = len(timeline.storage_category)
    if edits is not None:
        # whole parameters out, each rank's padded shards in
        resident_cats = timeline.storage_category[timeline.storage_resident]
        resident_blocks = np.concatenate(
            [
                resident_blocks[resident_cats != CATEGORY_CODE[Category.PARAMETER]],
                edits.param_blocks.astype(object),
            ]
        )
        resident[CATEGORY_CODE[Category.PARAMETER]] = int(edits.param_blocks.sum())
        where = edits.position
        seq = np.insert(seq, where, edits.nbytes.astype(seq.dtype))
        modules = np.insert(modules, where, edits.row)
        phases = np.insert(phases, where, edits.phase)
        cats = np.insert(cats, where, edits.category)
        ops = np.insert(ops, where, np.full(len(where), -1, np.int32))
        if storage is not None:  # new storages after the timeline's own
            new_ids = np.where(edits.storage < 0, n_storages - 1 - edits.storage, edits.storage)
            storage = np.insert(storage, where, new_ids)
            n_storages += int((edits.storage < 0).sum())
        # inserted before the optimizer's step: all up to its position, but zero_grad's
        after = (where > timeline.optimizer_at) | (edits.phase == PHASE_CODE[Phase.ZERO_GRAD])
        k += int((~after).sum())
    generation: Generation | None = None
    unrolled: StepEvents | None = None
    if mode is Mode.GENERATE:
        if new_tokens is None or not timeline.step_starts:
            raise ValueError("a generation's estimate needs new_tokens and a recorded generation")
        assert timeline.step_flops is not None
        run = Recording(
            StepEvents(seq, modules, phases, cats, ops),
            timeline.step_starts,
            length,
            timeline.step_flops.at(batch_size, length),
        )
        across = None
        if across_window is not None:
            across, op_names = _recording(across_window, batch_size, op_names)
        unrolled, generation, flops_generated = unroll(run, new_tokens, batch_size, across)
        seq, modules, phases, cats, ops = (
            unrolled.nbytes,
            unrolled.module,
            unrolled.phase,
            unrolled.category,
            unrolled.op,
        )
        storage = None  # the unrolled steps have no storage ids: no allocator replay
    if train and opt is not None:
        n_opt = len(opt.event_bytes)
        if storage is not None and opt.event_storage is not None:
            # the optimizer's storages after the step's (ids of their own)
            opt_ids = opt.event_storage + n_storages
            storage = np.concatenate([storage[:k], opt_ids, storage[k:]])
        else:
            storage = None
        resident_blocks = np.concatenate([resident_blocks, opt.state_block_bytes.astype(object)])
        seq = np.concatenate([seq[:k], opt.event_bytes.astype(seq.dtype), seq[k:]])
        modules = np.concatenate([modules[:k], np.full(n_opt, n_rows - 1, np.int32), modules[k:]])
        phases = np.concatenate(
            [phases[:k], np.full(n_opt, PHASE_CODE[Phase.OPTIMIZER], np.int8), phases[k:]]
        )
        cats = np.concatenate([cats[:k], np.full(n_opt, _TEMPORARY, np.int8), cats[k:]])
        ops = np.concatenate([ops[:k], np.full(n_opt, -1, np.int32), ops[k:]])
        resident[CATEGORY_CODE[Category.OPTIMIZER_STATE]] += int(opt.state_bytes.sum())
    if communication_blocks:
        resident[CATEGORY_CODE[Category.COMMUNICATION]] += sum(communication_blocks)
        resident_blocks = np.concatenate(
            [resident_blocks, np.asarray(list(communication_blocks), dtype=object)]
        )
    resident_total = _as_int(resident.sum())
    live = resident_total + np.cumsum(seq) if len(seq) else np.zeros(0, dtype=np.int64)
    if len(live) and live.max() > resident_total:
        at = int(np.argmax(live))
        peak = _as_int(live[at])
        peak_phase = PHASES[int(phases[at])]
        peak_row = int(modules[at])
        peak_op = _op_shown(rows, peak_row, int(ops[at]), op_names)
        by_cat = sum_by(cats[: at + 1], seq[: at + 1], N_CATEGORIES)
        breakdown = {c: _as_int(resident[i] + by_cat[i]) for i, c in enumerate(CATEGORIES)}
        peak_step = None if unrolled is None else step_of(unrolled, at)
    else:
        peak = resident_total
        peak_phase = {Mode.TRAIN: Phase.FORWARD, Mode.GENERATE: Phase.PREFILL}.get(
            mode, Phase.INFERENCE
        )
        peak_row, peak_op = 0, ""
        peak_step = None if unrolled is None else 0
        breakdown = {c: _as_int(resident[i]) for i, c in enumerate(CATEGORIES)}

    extras = AcceleratorExtras(0, 0, 0)
    if device is Device.CUDA:
        if context is None:
            context = cuda_context(compute_capability)
        # one cuBLAS workspace per thread that runs a matmul: in training, autograd's
        # device thread runs the backward with a handle (and workspace) of its own
        workspaces = (2 if train else 1) if timeline.uses_matmul else 0
        extras = _cuda_extras(resident_blocks, seq, peak, compute_capability, workspaces, context)

    def per_row(category: Category) -> np.ndarray:
        return timeline.rows_of_category(category, batch_size, n_rows, length)

    param_bytes = per_row(Category.PARAMETER) if edits is None else edits.param_rows
    buffer_bytes = per_row(Category.BUFFER)
    grad_rows = per_row(Category.GRADIENT) if train else np.zeros(n_rows, np.int64)
    if train and edits is not None:
        grad_rows = edits.grad_rows
    act_rows = per_row(Category.ACTIVATION) if train else np.zeros(n_rows, np.int64)
    opt_rows = np.zeros(n_rows, np.int64)
    if train:  # the optimizer's trace, or a state the step holds itself (stepped in backward)
        opt_rows = opt.state_bytes if opt is not None else per_row(Category.OPTIMIZER_STATE)
    # int64 while it fits; Python ints (object arrays) for astronomical batches
    flops_f = timeline.flops_forward.at(batch_size, length)
    flops_b = timeline.flops_backward.at(batch_size, length)
    if generation is not None:
        flops_f = flops_generated
    if not train:
        flops_b = np.zeros_like(flops_b)
    dims_poly, ndim = timeline.output_dims
    dims = dims_poly.at(batch_size, length)
    if batch_size >= 2**31:  # products past int64: exact Python ints
        dims = dims.astype(object)
    numel = np.where(ndim >= 0, dims.prod(axis=1), 0)
    layers = LayerTable(
        name=rows.names,
        type=rows.types,
        depth=rows.depths,
        output_dims=dims,
        output_ndim=ndim,
        output_numel=numel,
        param_count=rows.param_count,
        param_bytes=param_bytes,
        buffer_bytes=buffer_bytes,
        gradient_bytes=grad_rows,
        optimizer_state_bytes=opt_rows,
        activation_bytes=act_rows,
        flops_forward=flops_f,
        flops_backward=flops_b,
    )
    return MemoryEstimate(
        batch_size=batch_size,
        precision=precision,
        optimizer=optimizer if train else None,
        optimizer_implementation=(
            optimizer_implementation if train and optimizer is not None else None
        ),
        paged_bytes=opt.paged_bytes if train and opt is not None else 0,
        compile_fallbacks=timeline.compile_fallbacks if train else (),
        host_bytes=(
            0
            if timeline.host_bytes is None or not train
            else _as_int(timeline.host_bytes.at(batch_size, length)[0])
        ),
        mode=mode,
        device=device,
        seq_len=seq_len,
        peak_bytes=peak,
        peak_phase=peak_phase,
        # in a generation the rows outside the model are generate's own loop (the logits
        # copy, its processors, the generated ids), not a loss
        peak_module=(
            "generate"
            if mode is Mode.GENERATE and peak_row == n_rows - 2
            else module_label(rows, peak_row)
        ),
        peak_op=peak_op,
        parameter_bytes=_as_int(resident[CATEGORY_CODE[Category.PARAMETER]]),
        buffer_bytes=_as_int(resident[CATEGORY_CODE[Category.BUFFER]]),
        gradient_bytes=int(grad_rows.sum()),
        optimizer_state_bytes=int(opt_rows.sum()),
        activation_bytes=int(act_rows.sum()),
        input_bytes=_as_int(resident[CATEGORY_CODE[Category.INPUT]]),
        communication_bytes=_as_int(resident[CATEGORY_CODE[Category.COMMUNICATION]]),
        peak_breakdown=breakdown,
        flops_forward=_as_int(flops_f.sum()),
        flops_backward=_as_int(flops_b.sum()),
        extras=extras,
        exact=timeline.exact,
        layers=layers,
        live_bytes=live,
        event_module=modules,
        event_phase=phases,
        event_category=cats,
        levers=levers if train else NO_LEVERS,
        event_storage=storage,
        event_bytes=seq,
        resident_storage_bytes=resident_blocks,
        expandable_segments=expandable_segments,
        gpus=parallel.gpus,
        strategy=parallel.strategy if parallel.distributed else None,
        rank=rank,
        generation=generation,
        peak_step=peak_step,
        nccl=(
            nccl_buffers(
                STRATEGIES[parallel.strategy].communicators,
                min(parallel.gpus, parallel.gpus_per_node),
                compute_capability,
            )
            if device is Device.CUDA and train and parallel.distributed
            else None
        ),
    )


def _recording(
    across_window: tuple[Timeline, int], batch_size: int, op_names: tuple[str, ...]
) -> tuple[Recording, tuple[str, ...]]:
    """A generation recorded at another prompt (across a sliding window) at ``batch_size``,
    its ops renamed into ``op_names`` (extended by those it adds): the two runs number their
    ops apart."""
    timeline, prompt_len = across_window
    if batch_size == 1 and timeline.batch_one is not None:
        timeline = timeline.batch_one
    names = list(op_names)
    code = {name: i for i, name in enumerate(names)}
    for name in timeline.op_names:
        if name not in code:
            code[name] = len(names)
            names.append(name)
    renamed = np.asarray([code[name] for name in timeline.op_names] + [-1], dtype=np.int32)
    assert timeline.step_flops is not None
    events = StepEvents(
        timeline.events_at(batch_size, prompt_len),
        timeline.event_module,
        timeline.event_phase,
        timeline.event_category,
        renamed[timeline.event_op],  # -1 (no op) stays -1: the last entry
    )
    flops = timeline.step_flops.at(batch_size, prompt_len)
    return Recording(events, timeline.step_starts, prompt_len, flops), tuple(names)


def module_label(rows: ModuleRows, row: int) -> str:
    """A row's qualified name; the root (whose name is ``""``) by its class."""
    return rows.names[row] or rows.types[row] or "(root)"


def _op_shown(rows: ModuleRows, row: int, op: int, op_names: tuple[str, ...]) -> str:
    """The op at the peak where it says more than the module does: in a module with children
    (its own code between them: the root's loss, attention math), or the loss / optimizer
    pseudo-rows; not in a leaf module, whose op its type already names."""
    if op < 0:
        return ""
    depths = rows.depths
    n_modules = len(rows.names) - 2
    leaf = row < n_modules and (row + 1 >= n_modules or depths[row + 1] <= depths[row])
    return "" if leaf and row != 0 else op_names[op]


def _blocks(nbytes: np.ndarray) -> np.ndarray:
    """``cuda_block_bytes`` for int64 arrays, and the same rule on Python ints (object arrays,
    astronomical batches) where int64 would overflow."""
    if nbytes.dtype != object:
        return cuda_block_bytes(nbytes.astype(np.int64))
    rounded = (nbytes + 511) // 512 * 512
    return np.where(nbytes == 0, 0, np.where(rounded < 512, 512, rounded))


def _cuda_extras(
    resident_blocks: np.ndarray,
    seq: np.ndarray,
    peak: int,
    compute_capability: tuple[int, int],
    workspaces: int,
    context: CudaContext,
) -> AcceleratorExtras:
    """What CUDA adds on top of tensor bytes: each block rounded up to 512 bytes by the
    caching allocator, the cuBLAS workspace, and the CUDA context (sources in _accelerator).
    ``resident_blocks``: every storage resident before the step (optimizer state and a
    strategy's buffers included)."""
    rounded_resident = _as_int(_blocks(resident_blocks).sum())
    rounded_seq = np.where(seq < 0, -1, 1) * _blocks(np.where(seq < 0, -seq, seq))
    rounded_peak = rounded_resident
    if len(rounded_seq):
        rounded_peak = max(rounded_peak, rounded_resident + int(np.cumsum(rounded_seq).max()))
    return AcceleratorExtras(
        allocator_rounding_bytes=max(0, rounded_peak - peak),
        cublas_workspace_bytes=workspaces
        * cublas_workspace_bytes(10 * compute_capability[0] + compute_capability[1]),
        cuda_context_bytes=context.nbytes,
        cuda_context_source=context.source,
        cublas_workspace_count=workspaces,
    )
