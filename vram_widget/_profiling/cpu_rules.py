"""What CPU kernels allocate that their fake (meta) kernels do not: rules for ``device="cpu"``.

Fake tensors run meta kernels, which allocate an op's outputs and nothing else. Where a CPU
kernel allocates differently, and what it does is fixed by its source (no thread count or
library choice in it), the recorder applies a rule from this module instead of running the
kernel for real (``probe.py`` does that where the source is not so simple).

BatchNorm (aten/src/ATen/native/Normalization.cpp and cpu/batch_norm_kernel.cpp):

* The backward allocates only the gradients its ``output_mask`` asks for
  (``batch_norm_backward_cpu_template``: ``if (grad_input_mask[0]) grad_input =
  at::empty_like(...)``, and so on); the meta kernel returns ``grad_input`` whatever the mask,
  so a BatchNorm whose input needs no gradient (the first layer) gained one input-sized
  tensor in the backward.
* When input and ``grad_out`` are contiguous in the same memory format, that template
  allocates ``grad_input`` a second time (``grad_input = at::empty_like(input,
  suggest_memory_format_contig(input))``) before the first is freed: one more input-sized
  block, live beside the three gradients for the call.
* The forward of a contiguous (NCHW-like) input with more than one value per sample and
  channel allocates two per-channel tensors in the computation type for the call
  (``batch_norm_cpu_contiguous_impl``: ``alpha``, ``beta``, float for bf16/fp16 inputs; in
  training ``batch_norm_cpu_update_stats_template`` first allocates ``_mean`` and
  ``_var_sum``, two per-channel tensors no larger, freed before ``alpha`` and ``beta``).

  Channels-last inputs and inputs with one value per sample and channel (a ``BatchNorm1d``
  on ``N x C``) take the channels-last kernels, which allocate the same ``alpha`` and ``beta``.

Eager calls (every op, :func:`promotion_copy_bytes`, :func:`wrapped_scalar_bytes`,
:func:`kept_scalar_bytes`): TensorIterator's copies of inputs whose dtype is not the
computation dtype, the 0-dim tensors Python numbers are wrapped in for the call, and those
autograd keeps into the backward.

Not emulated: the channels-last kernels' reduction buffers in training
(``batch_norm_cpu_collect_stats_channels_last_impl``: ``threads x C`` beside ``_mean`` and
``_var_sum`` when there are more rows than threads, and always for bf16 / fp16, measured;
``batch_norm_cpu_backward_channels_last_impl``: ``2 x threads x C``). They depend on the
thread count and switch on with the batch (not affine in it), so a rule would need the
workspace grid of ``probe.py``. Nor non-contiguous inputs.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .fake import is_in_place

aten = torch.ops.aten

__all__ = [
    "KEEPS_NUMBER_ARGS",
    "batch_norm_scratch_bytes",
    "gloo_staging_bytes",
    "kept_scalar_bytes",
    "promotion_copy_bytes",
    "unallocated_outputs",
    "wrapped_scalar_bytes",
]

# Forward ops whose CPU kernel is batch_norm_cpu_out; the input is argument 0.
_BATCH_NORM_FORWARD = frozenset(
    {
        aten.native_batch_norm.default,
        aten._native_batch_norm_legit.default,
        aten._native_batch_norm_legit.no_stats,
        aten._native_batch_norm_legit_no_training.default,
        aten._batch_norm_with_update.default,
        aten._batch_norm_no_update.default,
    }
)
# Backward ops whose CPU kernel is batch_norm_backward_cpu_template: (grad_out, input, ...)
# with the output mask at argument 9.
_BATCH_NORM_BACKWARD = frozenset(
    {aten.native_batch_norm_backward.default, aten.batch_norm_backward.default}
)
_MASK_ARG = 9


def unallocated_outputs(func: Any, args: tuple[Any, ...]) -> frozenset[int]:
    """Positions of the outputs a CPU kernel leaves undefined but the fake kernel returns.

    Examples
    --------
    >>> import torch
    >>> aten = torch.ops.aten
    >>> x = torch.zeros(2, 3, 4)
    >>> w = torch.ones(3)
    >>> args = (x, x, w, w, w, w, w, True, 1e-5, [False, True, True])
    >>> sorted(unallocated_outputs(aten.native_batch_norm_backward.default, args))
    [0]
    """
    if func in _BATCH_NORM_BACKWARD and len(args) > _MASK_ARG:
        return frozenset(i for i, wanted in enumerate(args[_MASK_ARG]) if not wanted)
    return frozenset()


def _opmath_itemsize(dtype: torch.dtype) -> int:
    """Bytes of one element of the CPU kernels' computation type: float for bf16 / fp16
    (``at::opmath_type``), the dtype itself otherwise."""
    return 4 if dtype in (torch.bfloat16, torch.float16) else dtype.itemsize


def _same_contiguous_format(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Both contiguous in one memory format (the template's ``all_contiguous``)."""
    if a.is_contiguous() and b.is_contiguous():
        return True
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(a.dim())
    return (
        fmt is not None
        and a.dim() == b.dim()
        and a.is_contiguous(memory_format=fmt)
        and b.is_contiguous(memory_format=fmt)
    )


def batch_norm_scratch_bytes(func: Any, args: tuple[Any, ...]) -> int:
    """Bytes a CPU BatchNorm kernel allocates and frees inside the call, beside its outputs.

    Examples
    --------
    >>> import torch
    >>> aten = torch.ops.aten
    >>> x = torch.zeros(4, 64, 14, 14)
    >>> c = torch.ones(64)
    >>> batch_norm_scratch_bytes(aten.native_batch_norm.default, (x, c, c, c, c, False, 0.1, 1e-5))
    512
    >>> mask = [True, True, True]  # grad_input allocated twice: one more 4*64*14*14*4 B
    >>> args = (x, x, c, c, c, c, c, True, 1e-5, mask)
    >>> batch_norm_scratch_bytes(aten.native_batch_norm_backward.default, args)
    200704
    """
    if func in _BATCH_NORM_FORWARD:
        x = args[0]
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.numel() == 0:
            return 0
        channels = x.shape[1]
        # alpha and beta: 2 x C elements of the computation type, on either kernel path
        return 2 * channels * _opmath_itemsize(x.dtype)
    if func in _BATCH_NORM_BACKWARD and len(args) > _MASK_ARG:
        grad_out, x = args[0], args[1]
        if not (isinstance(grad_out, torch.Tensor) and isinstance(x, torch.Tensor)):
            return 0
        if not args[_MASK_ARG][0] or x.numel() == 0 or not _same_contiguous_format(x, grad_out):
            return 0
        # the first grad_input (empty_like(input)), freed when the second replaces it
        return x.numel() * x.element_size()
    return 0


def _reduce_scatters() -> frozenset[Any]:
    try:
        ops = torch.ops._c10d_functional
        return frozenset(
            {ops.reduce_scatter_tensor.default, ops.reduce_scatter_tensor_coalesced.default}
        )
    except (AttributeError, RuntimeError):  # a torch built without distributed
        return frozenset()


# Functional reduce-scatters (DTensor's Partial -> Shard redistribution); argument 0 is the
# input tensor (or the list of them)
_REDUCE_SCATTERS = _reduce_scatters()


def gloo_staging_bytes(func: Any, args: tuple[Any, ...]) -> int:
    """The bytes gloo (the CPU backend) stages for a functional reduce-scatter, else 0.

    ``ProcessGroupGloo::reduce_scatter_tensor_coalesced`` (torch/csrc/distributed/c10d/
    ProcessGroupGloo.cpp) allreduces a clone of each whole input
    (``buffers.push_back(inputTensors[i].clone())``), allocated after the output
    (``_c10d_functional``'s kernel makes the output first) and freed with the work, at the
    ``wait_tensor`` of the output. NCCL's reduce-scatter stages nothing of the kind.

    Examples
    --------
    >>> x = torch.zeros(8, 4)
    >>> gloo_staging_bytes(torch.ops._c10d_functional.reduce_scatter_tensor.default, (x,))
    128
    >>> gloo_staging_bytes(torch.ops.aten.add.Tensor, (x, x))
    0
    """
    if func not in _REDUCE_SCATTERS:
        return 0
    inputs = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
    return sum(t.numel() * t.element_size() for t in inputs)


# Pointwise ops whose listed tensor arguments are not promoted to the computation dtype
# (the condition of ``where``, the mask of ``masked_fill``).
_UNPROMOTED_ARGS: dict[Any, frozenset[int]] = {
    torch.ops.aten.where.self: frozenset({0}),
    torch.ops.aten.masked_fill.Tensor: frozenset({1}),
    torch.ops.aten.masked_fill.Scalar: frozenset({1}),
    torch.ops.aten.masked_fill_.Tensor: frozenset({1}),
    torch.ops.aten.masked_fill_.Scalar: frozenset({1}),
}


def promotion_copy_bytes(func: Any, args: tuple[Any, ...], out: Any) -> int:
    """CPU bytes a pointwise op spends casting tensors of mixed dtypes.

    On the CPU, TensorIterator makes a copy of every input whose dtype differs from the
    computation dtype, and computes an in-place op whose ``self`` has another dtype into a
    temporary output (``compute_types``: "Creates temporaries for CPU operations",
    aten/src/ATen/TensorIterator.cpp; CUDA kernels cast as they load, with no copy). Those
    copies live for the call, beside its output. The computation dtype is the output's for
    an out-of-place op, else the promotion of the inputs with dimensions (comparisons give
    bool; in-place ops keep ``self``'s dtype). Measured for 20 ops (mul, div, add_,
    mul_, where, addcmul, eq, gt, logical_and, clamp, fmod, hypot, threshold_backward, ...):
    a bf16 input beside an fp32 one costs ``numel * 4`` bytes, 0-dim ones included; an
    amp-bf16 forward on the CPU hits this wherever a bf16 activation meets an fp32 tensor.
    """
    tags = getattr(func, "tags", ())
    if torch.Tag.pointwise not in tags:
        return 0
    skip = _UNPROMOTED_ARGS.get(func, frozenset())
    tensors = [a for i, a in enumerate(args) if isinstance(a, torch.Tensor) and i not in skip]
    if not tensors:
        return 0
    in_place = is_in_place(func)
    if not in_place and isinstance(out, torch.Tensor) and out.dtype is not torch.bool:
        common = out.dtype
    else:
        shaped = [t for t in tensors if t.dim() > 0] or tensors
        common = functools.reduce(torch.promote_types, (t.dtype for t in shaped))
    itemsize = common.itemsize
    total = sum(t.numel() * itemsize for t in tensors if t.dtype != common)
    if in_place and tensors[0].dtype != common:
        total += tensors[0].numel() * itemsize  # computed into a temporary, then cast back
    return total


# Ops whose backward node keeps a Python-number argument when the other argument needs a
# gradient (tools/autograd/derivatives.yaml: ``mul.Tensor: self: mul_tensor_backward(grad,
# other, ...)``, ``other: mul_tensor_backward(grad, self, ...)``; ``div.Tensor: self:
# div_tensor_self_backward(grad, other, ...)``, ``other: div_tensor_other_backward(grad, self,
# other)``; the in-place forms alike). The node keeps the number's wrapped 0-dim tensor
# (SavedVariable saves a wrapped number as it is, without the saved-tensor hooks), so on the
# CPU its 8 bytes live until that node's backward has run: measured, ``x * 0.5`` in a forward
# holds 8 B into the backward, one per LoRA adapter (``lora_B(...) * scaling``).
KEEPS_NUMBER_ARGS = frozenset(
    {
        torch.ops.aten.mul.Tensor,
        torch.ops.aten.mul_.Tensor,
        torch.ops.aten.div.Tensor,
        torch.ops.aten.div_.Tensor,
    }
)


def kept_scalar_bytes(func: Any, args: tuple[Any, ...]) -> int:
    """Bytes of a wrapped Python number that autograd keeps past the call (see
    ``KEEPS_NUMBER_ARGS``): only where a node is made (grad mode on, the other argument
    requires grad)."""
    if func not in KEEPS_NUMBER_ARGS or len(args) < 2 or not torch.is_grad_enabled():
        return 0
    for number, tensor in ((args[1], args[0]), (args[0], args[1])):
        if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
            return _wrapped_size(number)
    return 0


def _wrapped_size(value: object) -> int:
    """Bytes of the 0-dim tensor the argument parser wraps a Python number in: float64 for
    a float, int64 for an int, bool 1 byte, complex128; 0 for anything else."""
    if isinstance(value, bool):
        return 1
    if isinstance(value, complex):
        return 16
    if isinstance(value, (int, float)):
        return 8
    return 0


def wrapped_scalar_bytes(func: Any, args: tuple[Any, ...]) -> int:
    """CPU bytes eager PyTorch spends on Python numbers passed as Tensor arguments.

    ``x / 1.5`` reaches a dispatch mode as ``aten.div.Tensor(x, 1.5)``; in eager mode the
    argument parser wraps 1.5 in a 0-dim float64 tensor (8 bytes; int64 for ints, bool 1 byte)
    that lives for the call, and the CPU TensorIterator casts it to the computation dtype (one
    more element) inside the op. Seen as 12 bytes at Adam's peak on the CPU (``denom``).
    """
    schema = getattr(func, "_schema", None)
    if schema is None:
        return 0
    total = 0
    common_itemsize = 0
    for arg_schema, value in zip(schema.arguments, args, strict=False):
        if isinstance(value, torch.Tensor):
            common_itemsize = common_itemsize or value.element_size()
            continue
        if not isinstance(value, (bool, int, float, complex)):
            continue
        if not isinstance(arg_schema.type, torch.TensorType):
            continue
        total += _wrapped_size(value)
    if total and common_itemsize and common_itemsize != total:
        total += common_itemsize  # the cast copy to the computation dtype
    return total
