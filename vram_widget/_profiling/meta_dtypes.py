"""Where a real kernel's dtypes differ from its meta kernel's, as the recorder sees them: ops
whose kernels take dtypes their meta kernels refuse (:data:`ANY_DTYPE_OPS`), and fused CPU
kernels whose outputs CPU autocast makes lower precision where their meta kernels keep the
input's dtype (:data:`AUTOCAST_FUSED_OPS`, :func:`in_dtype`)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ANY_DTYPE_OPS", "AUTOCAST_FUSED_OPS", "grouped_mm_in_any_dtype", "in_dtype"]


def grouped_mm_in_any_dtype(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``aten._grouped_mm`` in any floating dtype. Its meta kernel refuses anything but bf16
    (torch/_meta_registrations.py, ``_meta_grouped_mm_common``, "Implementing all the checks
    from _grouped_mm_cuda()"), but the kernels run every dtype: the CUDA one takes its CUTLASS
    fast path for bf16 on sm90/sm100 and otherwise ``_grouped_mm_fallback``, an mm per group
    into the output it allocated (aten/src/ATen/native/cuda/GroupedBlas.cpp,
    ``_grouped_mm_cuda``), and the CPU one runs float32 too (measured, torch 2.13). Either
    allocates the output alone: the meta kernel's layout in the result dtype."""
    a, b = args[0], args[1]
    if a.dtype == b.dtype == torch.bfloat16 or not (
        a.is_floating_point() and b.is_floating_point()
    ):
        return func(*args, **kwargs)
    out_dtype = kwargs.get("out_dtype") or (args[4] if len(args) > 4 else None) or a.dtype

    def bf16(x: Any) -> Any:
        return x.to(torch.bfloat16) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    rest = {k: v for k, v in kwargs.items() if k != "out_dtype"}
    out = func(
        bf16(a), bf16(b), *(bf16(x) for x in args[2:4]), **{k: bf16(v) for k, v in rest.items()}
    )
    return out.to(out_dtype)


# Ops whose kernels take dtypes their meta kernels refuse (torch >= 2.8 has _grouped_mm)
ANY_DTYPE_OPS: dict[Any, Any] = (
    {torch.ops.aten._grouped_mm.default: grouped_mm_in_any_dtype}
    if hasattr(torch.ops.aten, "_grouped_mm")
    else {}
)

# Fused CPU kernels that autocast does not cast, but whose inner matmuls it does: under CPU
# autocast they return the autocast dtype (measured: bf16 from fp32 inputs), where their meta
# kernels keep the input's dtype. The next layer then gets a bf16 input, as in a real step.
AUTOCAST_FUSED_OPS = frozenset(
    {
        torch.ops.aten._transformer_encoder_layer_fwd.default,
        torch.ops.aten._native_multi_head_attention.default,
    }
)


def in_dtype(out: Any, dtype: torch.dtype) -> Any:
    """The op's floating fp32 outputs as new tensors of ``dtype`` (same sizes and strides),
    made by the mode below the recorder (fake tensors), so nothing is recorded for them
    but the outputs themselves."""

    def cast(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
            return torch.empty_strided(tuple(t.shape), t.stride(), dtype=dtype, device=t.device)
        return t

    if isinstance(out, (tuple, list)):
        return type(out)(cast(t) for t in out)
    return cast(out)
