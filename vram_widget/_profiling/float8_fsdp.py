"""One FSDP2 rank's step with torchao's float8 all-gather, run by torchao and FSDP2
themselves on fake tensors and PyTorch's fake process group.

With ``Float8LinearConfig(enable_fsdp_float8_all_gather=True)`` each converted weight is a
``WeightWithDynamicFloat8CastTensor`` (torchao/float8/fsdp_utils.py) whose
``fsdp_pre_all_gather`` casts the shard to float8 (its amax all-reduced over the mesh
first: ``hp_tensor_to_float8_dynamic(..., reduce_amax=True, device_mesh=mesh)``), so FSDP2
gathers one byte a value and a float32 scale, and the forward and backward use the
gathered ``Float8TrainingTensor`` as it is (``tensor_already_casted_to_fp8``,
torchao/float8/float8_linear.py). These are changes inside each layer's step, not a
transform of the single-device timeline, so the rank is not derived from the float8
profile: :func:`float8_fsdp_rank` runs it. A meta copy of the model is made fake in the
precision's dtype, converted by ``convert_to_float8_training`` (``float8.converted``),
given its levers (``step.apply_levers``: activation checkpointing) and wrapped by
``fully_shard`` on the strategy's mesh as ``measure``'s ranks do it
(``distributed.fsdp_mesh``, ``distributed.fully_sharded``), and stepped three times by the
same training iteration (its ``grad_accumulation`` micro-batches each); the third step is
counted by ``live_bytes.LiveBytes`` (the first two make the optimizer's state and FSDP2's
lazy state), and the collectives it issues are logged (``collectives.CollectiveLog``).

The device, as the single-device float8 profile takes it (``float8.py``):

- a CPU rank (``cuda=False``) runs ``emulate=True``, as torchao does on a CPU, with the
  CPU's kernel workspaces (``probe.py``), the CPU generator states checkpointing keeps,
  and each collective's gloo staging copies beside what is live at it
  (``pipeline_fsdp.GLOO_STAGING``): exact against gloo ranks.
- a CUDA rank (``cuda=True``) runs ``emulate=False``, torchao's ``torch._scaled_mm`` path,
  its forward (and a checkpointed forward's recompute) under the CUDA kernel choices
  (``cuda_rules.CudaEmulation``), without the CPU's within-call copies, gloo's staging
  (NCCL gathers and reduces in FSDP2's buffers, and averages natively:
  ``sharding.gloo_average_bytes``) or host memory (generator states), and counts each
  storage's caching-allocator block (512-byte multiples) beside its bytes. FSDP2's
  collectives are taken in the order the CPU run issues them (one stream, as the
  estimate's FSDP2 rule takes them on CUDA); the ``_scaled_mm`` kernel's cuBLAS / CUTLASS
  workspace is not seen on fake tensors, and the allocation stream is not kept, so the
  reserved figure is not derived. UNCONFIRMED on a GPU.

The peak is counted as ``measure`` counts a CPU rank's: above the tensors the rank lists
as resident at the step's start, read after it (a steady step ends as it starts):
parameters' shards, buffers, optimizer state, the batch. Beside
them FSDP2's unsharded ``Float8TrainingTensor`` of each weight keeps the previous step's
4-byte scale (``fsdp_post_all_gather`` sets ``out._scale``; resharding frees only the
gathered data), which ``measure`` lists too (``measure_session._Session.resident_tensors``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .._estimating.allocator import round_size
from .._estimating.communication import Collective
from .._estimating.levers import NO_LEVERS, Levers
from .._estimating.options import OptimizerChoice, OptimizerImplementation, Precision
from .._estimating.recipe.float8 import Float8
from .._estimating.sharding import Parallel

__all__ = ["Float8RankStep", "float8_fsdp_rank", "fsdp_held_tensors"]


@dataclasses.dataclass(frozen=True)
class Float8RankStep:
    """One FSDP2 rank's float8 all-gather step: its peak and resident bytes (as
    ``measure`` counts them) and the collectives it issued; for a CUDA rank, the same two
    with each storage counted as the caching allocator's block (``block_peak_bytes``,
    ``block_resident_bytes``: its bytes rounded up to a multiple of 512; None for a CPU
    rank)."""

    peak_bytes: int
    resident_bytes: int
    collectives: tuple[Collective, ...]
    block_peak_bytes: int | None = None
    block_resident_bytes: int | None = None


def fsdp_held_tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    """The tensors FSDP2 holds for ``model``'s parameters beside their shards: each
    ``FSDPParam``'s unsharded parameter, where it is made (torch/distributed/fsdp/
    _fully_shard/_fsdp_param.py, ``init_unsharded_param``); a torchao float8 one as its
    inner tensors (its data, resized to nothing after resharding, and its scale). Nothing
    for a model ``fully_shard`` did not wrap."""
    from .tensor_parallel import local_part
    from .torchao_weights import torchao_inner

    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        if state is None:
            continue
        group = getattr(state(), "_fsdp_param_group", None)
        for fsdp_param in getattr(group, "fsdp_params", ()):
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if not isinstance(unsharded, torch.Tensor):
                continue
            part = local_part(unsharded)
            yield from torchao_inner(part) or [part]


def _fake_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A meta copy of ``model`` whose parameters and buffers are fake CPU tensors (the
    floating ones in ``dtype``), tied ones kept tied; call inside the fake mode."""
    from .step import fake_tensors_in_place, meta_copy

    copy_ = meta_copy(model)
    fake_tensors_in_place([copy_], dtype)
    return copy_


def _listed_bytes(tensors: Iterator[torch.Tensor]) -> tuple[int, int]:
    """The bytes of the storages of ``tensors`` (DTensors as their shards), each once, and
    the same with each non-empty storage rounded up to the caching allocator's block."""
    from .tensor_parallel import local_part

    storages = {local_part(t).untyped_storage(): None for t in tensors}
    sizes = [s.nbytes() for s in storages]
    return sum(sizes), sum(round_size(n) for n in sizes if n > 0)


def float8_fsdp_rank(
    model: nn.Module,
    make_inputs: Callable[[], Any],
    loss_fn: Callable[[Any], Any] | None,
    float8: Float8,
    parallel: Parallel,
    precision: Precision,
    optimizer: OptimizerChoice | None,
    implementation: OptimizerImplementation | None = None,
    rank: int = 0,
    levers: Levers = NO_LEVERS,
    cuda: bool = False,
) -> Float8RankStep:
    """Rank ``rank`` of ``parallel`` (FSDP2: zero2, zero3 or hsdp) training ``model``
    converted by torchao with ``float8.all_gather``, on fake tensors: see the module's
    docstring. ``make_inputs()`` gives the batch (a ``subject.ModelInputs``), called
    inside the fake mode; ``loss_fn`` as the profile takes it; ``levers`` resolved to
    names (activation checkpointing, gradient accumulation); ``cuda``: a CUDA rank (the
    ``_scaled_mm`` path, CUDA's kernel choices and allocator blocks) instead of a CPU one."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .distributed import fsdp_mesh, fully_sharded
    from .float8 import converted
    from .step import apply_levers, storage_dtype
    from .tensor_parallel import fake_process_group

    dtype = storage_dtype(precision)
    mode = FakeTensorMode()
    with fake_process_group(parallel.gpus, rank=rank):
        mesh = fsdp_mesh(parallel)  # before the fake mode: a mesh reads its ranks' values
        reshard = parallel.reshard_after_forward
        assert reshard is not None  # FSDP2's strategies (float8.FSDP2_STRATEGIES)
        with mode:
            # as measure's rank: converted, its levers applied, then wrapped
            copy_ = converted(_fake_copy(model, dtype), float8, emulate=not cuda)
            apply_levers(copy_, levers)
            wrapped = fully_sharded(copy_, parallel, precision, mesh, reshard)
            step = _run(
                wrapped, make_inputs, loss_fn, precision, optimizer, implementation,
                levers.grad_accumulation, cuda,
            )  # fmt: skip
    return step


def _run(
    wrapped: nn.Module,
    make_inputs: Callable[[], Any],
    loss_fn: Callable[[Any], Any] | None,
    precision: Precision,
    optimizer: OptimizerChoice | None,
    implementation: OptimizerImplementation | None,
    micro_batches: int,
    cuda: bool,
) -> Float8RankStep:
    """Three steps of the wrapped fake model, the third counted (inside the fake mode)."""
    from .collectives import CollectiveLog
    from .fake import checkpoint_recompute_context
    from .float8 import Float8Kernels
    from .live_bytes import LiveBytes
    from .pipeline_fsdp import GLOO_STAGING
    from .probe import KernelProbe
    from .step import make_optimizer, training_iteration
    from .torchao_weights import torchao_inner

    counter = LiveBytes(None if cuda else KernelProbe(), cuda=cuda)
    if not cuda:  # NCCL works in FSDP2's own buffers
        counter.staging = dict(GLOO_STAGING)
    log = CollectiveLog()
    wrapped.train()
    batch = make_inputs()
    params = [p for p in wrapped.parameters() if p.requires_grad]
    opt = None if optimizer is None else make_optimizer(optimizer, params, implementation)
    context = _cuda_context() if cuda else None

    def iterate() -> None:
        training_iteration(
            wrapped, batch, loss_fn, opt, precision, "cpu", params=params,
            micro_batches=micro_batches, context=context,
        )  # fmt: skip

    def resident() -> tuple[int, int]:
        listed: list[torch.Tensor] = []
        for p in wrapped.parameters():
            shard = p.to_local() if hasattr(p, "to_local") else p
            listed.extend(torchao_inner(shard) or [shard])
        listed.extend(wrapped.buffers())
        listed.extend(fsdp_held_tensors(wrapped))
        if opt is not None:
            for state in opt.state.values():
                listed.extend(v for v in state.values() if isinstance(v, torch.Tensor))
        listed.extend(batch.tensors())
        return _listed_bytes(iter(listed))

    for t in (*wrapped.parameters(), *wrapped.buffers(), *batch.tensors()):
        counter.track(t)
    with contextlib.ExitStack() as stack:
        stack.enter_context(counter)
        stack.enter_context(Float8Kernels())
        if context is None:  # a CPU step's allocator sees the generator states checkpoint keeps
            stack.enter_context(counter.rng_states())
        else:  # a checkpointed forward's recompute under CUDA's kernel choices too
            stack.enter_context(checkpoint_recompute_context(context))
        iterate()
        iterate()
        gc.collect()
        start, start_blocks = counter.live_bytes, counter.live_blocks
        counter.reset_peak()
        with log:  # innermost: it sees each op before the counter and the fake mode
            iterate()
        held, held_blocks = resident()
    # as measure counts a CPU rank: what it lists as resident, and the peak above the start
    above = counter.peak_with_workspaces() - start
    if not cuda:
        return Float8RankStep(held + above, held, tuple(log.collectives))
    blocks_above = counter.peak_blocks - start_blocks
    return Float8RankStep(
        held + above, held, tuple(log.collectives), held_blocks + blocks_above, held_blocks
    )


def _cuda_context() -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """The forward context of a CUDA rank: CUDA's kernel choices on the CPU fake tensors,
    as a ``device="cuda"`` profile runs its forward (``step_profiler``; no autocast: the
    amp precisions are refused with float8, ``check_float8``)."""
    from .cuda_rules import CudaEmulation
    from .cuda_sdpa import CudaTarget

    return lambda: CudaEmulation(CudaTarget(), None)
