"""FSDP2 over pipeline stages (``gpus = dp x pp``, ``strategy="zero2"|"zero3"``): each
pipeline stage's module sharded by ``fully_shard`` over the ``dp`` data-parallel ranks that
hold the same stage.

As torchtitan composes them (torchtitan 0.3, torchtitan/models/llama3/parallelize.py and
torchtitan/distributed/pipeline_parallel.py: the model split into stages on the ``pp``
sub-mesh, then each stage's model part parallelized alone), the world's ranks form a 2-D
mesh ``("pp", "dp_shard")``, pp the outer dimension (``ParallelDims.build_mesh``,
torchtitan/distributed/parallel_dims.py, ``["pp", "dp_replicate", "fsdp", "tp"]``): rank
``r`` holds stage ``r // dp`` as data-parallel rank ``r % dp``. Each stage's decoder layers
are wrapped by ``fully_shard``, then the stage itself (the pipeline's ``submod``) as the
root (torchtitan/distributed/fsdp.py, ``apply_fsdp_to_decoder``: each transformer block,
then ``fully_shard(model)``), over the ``dp_shard`` sub-mesh.

``reshard_after_forward`` is the strategy's: ``"zero3"`` True, ``"zero2"`` False for the
layers; the root (under either) keeps the library's default (None: not resharded after forward,
torch/distributed/fsdp/_fully_shard/_fsdp_state.py, ``_lazy_init``). torchtitan's own
default under pipelining is False (``get_fsdp_reshard_after_forward_policy``,
torchtitan/distributed/fsdp.py: "For PP, by default do not reshard after forward to avoid
per-microbatch all-gathers"), i.e. ``"zero2"``; its ``"always"`` policy is ``"zero3"``.

The schedule, not autograd, decides when gradients are reduced: every micro-batch's
backward runs with ``set_requires_gradient_sync(False)``, ``set_reshard_after_backward(False)``
and ``set_is_last_backward(False)`` (torch/distributed/pipelining/stage.py,
``_PipelineStageBase.backward_maybe_with_nosync``), so unsharded parameters and unsharded
gradients stay until the schedule's last backward, after which ``perform_reduce_grad``
(same file) reshards and reduce-scatters once (``post_backward`` on each parameter group).
The estimate runs exactly that code on fake tensors; nothing here restates it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._estimating.sharding import gloo_average_bytes

__all__ = ["GLOO_STAGING", "pipeline_rank", "shard_stage"]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# gloo (the CPU backend the estimate is checked against) stages each of FSDP2's collectives
# through copies it frees within the call: each all-gather through two flat temporaries of
# the output's size, one after the other (the first freed before the second is made: one
# output's size above what is live), each reduce-scatter through one of the input's, and
# with ReduceOp.AVG a wrapped number beside it (_reduce_scatter_staging); measured on torch
# 2.13's ProcessGroupGloo (torch/csrc/distributed/c10d/ProcessGroupGloo.cpp). The copies
# and the wrapped number are the rule sharding.fsdp_step_edits applies for FSDP2 alone
# (sharding.gloo_average_bytes for the latter). The fake process group stages nothing,
# so the estimate adds them at each call (c10d op -> its staging bytes, from the call's
# arguments: (output, input, group, ...), torch/csrc/distributed/c10d/Ops.cpp).
def _staging() -> dict[Any, Callable[[Any, Any], int]]:
    try:
        ops = torch.ops.c10d
        return {
            ops._allgather_base_.default: lambda args, _kw: _nbytes(args[0]),
            ops._reduce_scatter_base_.default: _reduce_scatter_staging,
        }
    except (AttributeError, RuntimeError):  # a torch built without distributed
        return {}


def _reduce_scatter_staging(args: Any, _kwargs: Any) -> int:
    """gloo's bytes within one ``_reduce_scatter_base_`` (``(output, input, group,
    reduce_op, ...)``): the copy of the input it reduces in; with ``ReduceOp.AVG`` (FSDP2's
    op for fp32 and bf16 gradients, ``_get_gradient_divide_factors``,
    torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py) it then divides that copy in
    place by the group's size, a Python number wrapped in an 8-byte tensor and cast to the
    gradients' dtype (one element) while the copy is live (``sharding.gloo_average_bytes``,
    which FSDP2's rule for one stage applies too). Measured on torch 2.13's gloo
    (the CPU profiler inside ``c10d::_reduce_scatter_base_``: ``aten::clone``,
    ``gloo:all_reduce``, ``aten::div_`` with 8 B and a 4 B ``aten::to`` in fp32, 2 B in
    bf16; nothing after the reduce with ``ReduceOp.SUM``).

    Examples
    --------
    >>> class Avg:  # the c10d ReduceOp object's ``op()``: its RedOpType's number
    ...     def op(self) -> int:
    ...         return 1
    >>> _reduce_scatter_staging((torch.empty(4), torch.empty(8), None, None), {})
    32
    >>> _reduce_scatter_staging((torch.empty(4), torch.empty(8), None, Avg()), {})
    44
    """
    staged = _nbytes(args[1])
    op = getattr(args[3], "op", None) if len(args) > 3 else None
    if callable(op) and op() == _AVG:
        staged += gloo_average_bytes(args[1].element_size())
    return staged


def _avg() -> int:
    """``ReduceOp.AVG``'s number, as the c10d ``ReduceOp`` object's ``op()`` gives it."""
    try:
        import torch.distributed as dist

        return int(dist.ReduceOp.AVG.value)
    except (AttributeError, ImportError):  # a torch built without distributed
        return -1


_AVG = _avg()


GLOO_STAGING = _staging()


def pipeline_rank(rank: int, dp: int) -> tuple[int, int]:
    """The (pipeline rank, data-parallel rank) of world rank ``rank`` on the
    ``("pp", "dp_shard")`` mesh, pp the outer dimension.

    Examples
    --------
    >>> pipeline_rank(3, 2)
    (1, 1)
    """
    return divmod(rank, dp)


def shard_stage(
    module: nn.Module,
    layers: nn.ModuleList,
    mesh: Any,
    reshard: bool,
    param_dtype: torch.dtype | None = None,
) -> None:
    """``module`` (a stage) sharded in place over ``mesh``: ``fully_shard`` on each of its
    decoder ``layers`` with ``reshard_after_forward=reshard``, then on ``module`` as the
    root (``reshard_after_forward=None``: the library's default for a root, as
    torchtitan's ``fully_shard(model, **fsdp_config)`` leaves it); with ``param_dtype``,
    ``MixedPrecisionPolicy(param_dtype, reduce_dtype=torch.float32)``, torchtitan's
    ``mixed_precision_param`` / ``mixed_precision_reduce`` (``apply_fsdp``)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy()
    if param_dtype is not None:
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(module, mesh=mesh, reshard_after_forward=None, mp_policy=policy)
