"""The CUDA kernels :class:`~.cuda_rules.CudaEmulation` calls in place of the CPU's: the fused
dropout, the attention backend op CUDA picks (:func:`sdpa_kernel`), softmax's half-to-float
kernel, and cross entropy's decomposition as CUDA's autocast sees it. Each is a
:data:`KernelFn`; :data:`~.cuda_rules.RULES` says which torch function takes which."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from .cuda_sdpa import SdpaBackend, SdpaCall, select_sdpa_backend

if TYPE_CHECKING:
    from .cuda_rules import CudaEmulation

__all__ = [
    "KernelFn",
    "SdpaCheck",
    "cross_entropy_kernel",
    "dropout_kernel",
    "half_to_float_kernel",
    "nll_loss_direct",
    "nll_loss_nd_kernel",
    "sdpa_backend_checked",
    "sdpa_kernel",
]

# (the mode, the torch function, its types, args, kwargs) -> what the CUDA kernel returns
KernelFn = Callable[["CudaEmulation", Callable[..., Any], Sequence[type], tuple, dict], Any]


def _bind(names: Sequence[str], defaults: dict[str, Any], args: tuple, kwargs: dict) -> dict:
    bound = dict(defaults)
    bound.update(zip(names, args, strict=False))
    bound.update(kwargs)
    return bound


# -- dropout --------------------------------------------------------------------------------

_DROPOUT_ARGS = ("input", "p", "training", "inplace")


def dropout_kernel(
    mode: CudaEmulation, func: Callable, types: Sequence[type], args: tuple, kwargs: dict
) -> Any:
    """``at::dropout`` takes ``native_dropout`` on CUDA when training with 0 < p < 1 and a
    non-empty input (``aten/src/ATen/native/Dropout.cpp · dropout, is_fused_kernel_acceptable``;
    fact sheet §2). Autograd then saves a bool mask instead of CPU's noise in the input dtype.
    ``inplace=True`` runs ``dropout_``, which never takes the fused path on CUDA either."""
    if func is torch.dropout:
        b = _bind(("input", "p", "train"), {}, args, kwargs)
        x, p, training, inplace = b["input"], b["p"], b["train"], False
    else:
        b = _bind(_DROPOUT_ARGS, {"p": 0.5, "training": True, "inplace": False}, args, kwargs)
        x, p, training, inplace = b["input"], b["p"], b["training"], b["inplace"]
    fused = (
        isinstance(x, torch.Tensor)
        and training
        and not inplace
        and isinstance(p, (int, float))
        and 0.0 < p < 1.0
        and x.numel() > 0
        and not x.is_nested
    )
    if not fused:
        return mode.passthrough(func, types, args, kwargs)
    return torch.native_dropout(x, float(p), True)[0]


# -- scaled dot-product attention ------------------------------------------------------------

_SDPA_ARGS = (
    "query",
    "key",
    "value",
    "attn_mask",
    "dropout_p",
    "is_causal",
    "scale",
    "enable_gqa",
)
_SDPA_DEFAULTS = {
    "attn_mask": None,
    "dropout_p": 0.0,
    "is_causal": False,
    "scale": None,
    "enable_gqa": False,
}


def _bool_mask_to_bias(mask: torch.Tensor | None, dtype: torch.dtype, fill: float) -> Any:
    # attention.cpp · convert_boolean_attn_mask (fill -inf) / convert_boolean_attn_mask_cudnn
    # (fill -65504): a new tensor of the mask's own shape in the query's dtype.
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask.logical_not(), fill, torch.scalar_tensor(0.0, dtype=dtype))


def _preprocess_mask(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    # attention.cpp · preprocess_mask / aligned_tensor<8> / pad_bias<8>: an unaligned mask is
    # padded (a copy of the unexpanded mask) and sliced back, then expanded (a view).
    aligned = mask.stride(-1) == 1 and all(mask.stride(i) % 8 == 0 for i in range(mask.dim() - 1))
    if not aligned:
        last = mask.size(-1)
        mask = F.pad(mask, (0, 8 - last % 8))[..., :last]
    return mask.expand(q.size(0), q.size(1), q.size(2), k.size(2))


def _pad_last_dim_8(t: torch.Tensor) -> torch.Tensor:
    # attention.cpp · pad_last_dim<8, false>: flash on CUDA pads the head dim to a multiple of 8,
    # and the flash op then saves the padded copies.
    rest = t.size(-1) % 8
    return t if rest == 0 else F.pad(t, (0, 8 - rest))


# check(backend, query, key, value, is_causal, enable_gqa), called on each emulated SDPA call
# once its backend is chosen and before it runs; it raises to refuse the call
SdpaCheck = Callable[[SdpaBackend, torch.Tensor, torch.Tensor, torch.Tensor, bool, bool], None]
_SDPA_CHECKS: list[SdpaCheck] = []


@contextlib.contextmanager
def sdpa_backend_checked(check: SdpaCheck) -> Iterator[None]:
    """Within the block, ``check`` sees the backend each emulated SDPA call picked (with
    its inputs, after autocast's casts) before the call runs, and may raise to refuse it:
    context parallelism's ring runs only some backends (``context_parallel.ring_attention``)."""
    _SDPA_CHECKS.append(check)
    try:
        yield
    finally:
        _SDPA_CHECKS.remove(check)


def sdpa_kernel(
    mode: CudaEmulation, func: Callable, types: Sequence[type], args: tuple, kwargs: dict
) -> Any:
    """The CUDA composite ``scaled_dot_product_attention`` (``aten/src/ATen/native/
    transformers/attention.cpp``), calling the backend op CUDA would pick (fact sheet §1)."""
    b = _bind(_SDPA_ARGS, _SDPA_DEFAULTS, args, kwargs)
    q, k, v, mask = b["query"], b["key"], b["value"], b["attn_mask"]
    dropout_p, is_causal, scale, gqa = b["dropout_p"], b["is_causal"], b["scale"], b["enable_gqa"]
    if any(t.is_nested for t in (q, k, v)):
        return mode.passthrough(func, types, args, kwargs)
    backend = select_sdpa_backend(mode.target, q, k, v, mask, dropout_p, is_causal, gqa)
    for check in _SDPA_CHECKS:
        check(backend, q, k, v, bool(is_causal), bool(gqa))
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    aten = torch.ops.aten
    # GQA (enable_gqa, unequal heads): attention.cpp · scaled_dot_product_attention hands k/v
    # to the flash / cuDNN ops un-repeated (the kernels index k/v head h // (Hq / Hkv); the
    # FA2 mha_fwd check num_heads % num_heads_k == 0 is UNCONFIRMED here, read in no source
    # copy), so they save the Hkv-head k/v and no copy; only math repeat_interleaves k and v
    # (attention.cpp · _scaled_dot_product_attention_math, and the 2.13 docstring's
    # reference code). tests/test_cuda_rules.py works the bytes out per backend.
    extra = {"enable_gqa": True} if gqa else {}  # 2.4 ops have no enable_gqa argument
    try:
        if backend is SdpaBackend.CUDNN:
            bias = _bool_mask_to_bias(mask, q.dtype, -65504.0)
            out = aten._scaled_dot_product_cudnn_attention(
                q,
                k,
                v,
                attn_bias=bias,
                compute_log_sumexp=needs_grad,
                dropout_p=dropout_p,
                is_causal=is_causal,
                return_debug_mask=False,
                scale=scale,
            )[0]
        elif backend is SdpaBackend.FLASH:
            head_dim = q.size(-1)
            og_scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
            out = aten._scaled_dot_product_flash_attention(
                _pad_last_dim_8(q),
                _pad_last_dim_8(k),
                _pad_last_dim_8(v),
                dropout_p,
                is_causal,
                False,
                scale=og_scale,
            )[0]
            if out.size(-1) != head_dim:  # post_process_flash_output
                out = out[..., :head_dim]
        elif backend is SdpaBackend.EFFICIENT:
            bias = _bool_mask_to_bias(mask, q.dtype, float("-inf"))
            if bias is not None:
                bias = _preprocess_mask(bias, q, k)
            out = aten._scaled_dot_product_efficient_attention(
                q, k, v, bias, needs_grad, dropout_p, is_causal, scale=scale
            )[0]
        else:
            # The math composite upcasts fp16/bf16 to fp32 on every device (§1.5). Calling it
            # directly avoids the CPU-only flash path that the original function could take.
            bias = _bool_mask_to_bias(mask, q.dtype, float("-inf"))
            out = aten._scaled_dot_product_attention_math(
                q, k, v, bias, dropout_p, is_causal, None, scale=scale, **extra
            )[0]
    except NotImplementedError:
        # Real CPU tensors: the fused ops have only CUDA and meta kernels (checked on 2.13).
        mode.sdpa_calls.append(_sdpa_record(backend, q, k, dropout_p, needs_grad, True))
        return mode.passthrough(func, types, args, kwargs)
    mode.sdpa_calls.append(_sdpa_record(backend, q, k, dropout_p, needs_grad, False))
    return out


def _sdpa_record(
    backend: SdpaBackend,
    q: torch.Tensor,
    k: torch.Tensor,
    dropout_p: float,
    requires_grad: bool,
    fell_back: bool,
) -> SdpaCall:
    four_d = q.dim() == 4
    return SdpaCall(
        backend=backend,
        batch=int(q.size(0)),
        heads=int(q.size(1)) if four_d else 1,
        q_len=int(q.size(-2)),
        kv_len=int(k.size(-2)),
        head_dim=int(q.size(-1)),
        dtype=q.dtype,
        dropout_p=float(dropout_p),
        requires_grad=requires_grad,
        fell_back=fell_back,
    )


# -- softmax with half_to_float -------------------------------------------------------------


def half_to_float_kernel(fused: Callable[..., torch.Tensor]) -> KernelFn:
    """``softmax``/``log_softmax`` of an fp16 CUDA tensor with ``dtype=float32`` call
    ``_softmax(x, dim, half_to_float=True)``: no fp32 copy of the input
    (``aten/src/ATen/native/SoftMax.cpp · softmax``; seen under fake-CUDA autocast, E3-style).
    bf16 is not special-cased there, so it converts first as on CPU."""

    def kernel(
        mode: CudaEmulation, func: Callable, types: Sequence[type], args: tuple, kwargs: dict
    ) -> Any:
        b = _bind(("input", "dim", "dtype"), {"dtype": None}, args, kwargs)
        x, dim, dtype = b["input"], b.get("dim"), b["dtype"]
        if (
            isinstance(x, torch.Tensor)
            and x.dtype == torch.float16
            and dtype == torch.float32
            and isinstance(dim, int)
            and set(b) <= {"input", "dim", "dtype"}
        ):
            try:
                return fused(x, dim, True)
            except RuntimeError:
                pass  # real CPU tensors: "conversion is not supported on CPU"
        # A builtin: there are no nested torch calls for the mode to see.
        return func(*args, **kwargs)

    return kernel


# -- cross_entropy / nll_loss under autocast -------------------------------------------------

_CE_ARGS = (
    "input",
    "target",
    "weight",
    "size_average",
    "ignore_index",
    "reduce",
    "reduction",
    "label_smoothing",
)
_CE_DEFAULTS = {
    "weight": None,
    "size_average": None,
    "ignore_index": -100,
    "reduce": None,
    "reduction": "mean",
    "label_smoothing": 0.0,
}


def _legacy_reduction(size_average: bool | None, reduce: bool | None) -> str:
    # torch/nn/_reduction.py · legacy_get_string
    size_average = True if size_average is None else size_average
    reduce = True if reduce is None else reduce
    if size_average and reduce:
        return "mean"
    return "sum" if reduce else "none"


_NLL_ARGS = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction")
_NLL_DEFAULTS = {
    "weight": None,
    "size_average": None,
    "ignore_index": -100,
    "reduce": None,
    "reduction": "mean",
}


def nll_loss_direct(args: tuple, kwargs: dict) -> bool:
    # nll_loss_nd calls nll_loss (1-D, 2-D) or nll_loss2d (4-D) directly on its input.
    x = args[0] if args else kwargs.get("input")
    return isinstance(x, torch.Tensor) and x.dim() in (1, 2, 4)


def nll_loss_nd_kernel(
    mode: CudaEmulation, func: Callable, types: Sequence[type], args: tuple, kwargs: dict
) -> Any:
    """``nll_loss_nd`` (``LossNLL.cpp``) reshapes 3-D and >4-D inputs to 4-D *before* the
    autocast-listed ``nll_loss2d`` casts them, so the cast is of the contiguous 4-D view."""
    if nll_loss_direct(args, kwargs):
        return func(*args, **kwargs)  # the fp32 policy has already cast the inputs
    b = _bind(_NLL_ARGS, _NLL_DEFAULTS, args, kwargs)
    x, target = b["input"], b["target"]
    reduction = b["reduction"]
    if b["size_average"] is not None or b["reduce"] is not None:
        reduction = _legacy_reduction(b["size_average"], b["reduce"])
    n, c = x.size(0), x.size(1)
    out_size = (n, *x.shape[2:])
    x = x.contiguous()
    target = target.contiguous()
    x = x.view(n, c, 1, -1) if x.numel() > 0 else x.view(n, c, 0, 0)
    target = target.view(n, 1, -1) if target.numel() > 0 else target.view(n, 0, 0)
    with mode:
        out = F.nll_loss(
            x, target, b["weight"], ignore_index=b["ignore_index"], reduction=reduction
        )
    return out if reduction != "none" else out.view(out_size)


def cross_entropy_kernel(
    mode: CudaEmulation, func: Callable, types: Sequence[type], args: tuple, kwargs: dict
) -> Any:
    """``cross_entropy_loss`` is **not** in CUDA's autocast lists, so CUDA's autocast sees the
    ops of its decomposition (``aten/src/ATen/native/LossNLL.cpp · cross_entropy_loss_symint``):
    ``log_softmax(x, dtype=x.dtype)`` stays in the input dtype (set_opt_dtype keeps it) and
    ``nll_loss`` (fp32 list) casts that to fp32 and saves the copy (fact sheet §5, E3).
    The decomposition is re-run in Python with this mode active so each op gets its policy."""
    b = _bind(_CE_ARGS, _CE_DEFAULTS, args, kwargs)
    x, target, weight = b["input"], b["target"], b["weight"]
    reduction = b["reduction"]
    if b["size_average"] is not None or b["reduce"] is not None:
        reduction = _legacy_reduction(b["size_average"], b["reduce"])
    ignore_index, smoothing = b["ignore_index"], float(b["label_smoothing"])
    with mode:
        class_dim = 0 if x.dim() == 1 else 1
        if x.shape == target.shape:
            return _ce_prob_target(x, target, weight, reduction, smoothing, class_dim)
        log_probs = torch.log_softmax(x, class_dim, dtype=x.dtype)
        nll = F.nll_loss(log_probs, target, weight, ignore_index=ignore_index, reduction=reduction)
        if smoothing <= 0.0:
            return nll
        return _ce_label_smoothing(
            log_probs, nll, target, weight, reduction, ignore_index, smoothing, class_dim
        )


def _ce_prob_target(
    x: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    reduction: str,
    smoothing: float,
    class_dim: int,
) -> torch.Tensor:
    # LossNLL.cpp · cross_entropy_loss_prob_target
    n_classes = x.size(class_dim)
    log_probs = torch.log_softmax(x, class_dim, dtype=x.dtype)
    if smoothing > 0.0:
        target = target * (1 - smoothing) + smoothing / n_classes
    product = log_probs * target
    if weight is not None:
        shape = [1] * log_probs.dim()
        if log_probs.dim() > 1:
            shape[1] = weight.size(0)
            product = product * weight.view(shape)
        else:
            product = product * weight
    if reduction == "mean":
        return -product.sum() / (log_probs.numel() / n_classes)
    if reduction == "sum":
        return -product.sum()
    return -product.sum(class_dim)


def _ce_label_smoothing(
    log_probs: torch.Tensor,
    nll: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    reduction: str,
    ignore_index: int,
    smoothing: float,
    class_dim: int,
) -> torch.Tensor:
    # LossNLL.cpp · cross_entropy_loss_label_smoothing (the tensor-subclass branch for the
    # weighted mean, which avoids a data-dependent masked_select and computes the same value).
    n_classes = log_probs.size(class_dim)
    if weight is not None:
        shape = [1] * log_probs.dim()
        shape[class_dim] = weight.size(0)
        smooth = -(log_probs * weight.view(shape)).sum(class_dim)
    else:
        smooth = -log_probs.sum(class_dim)
    ignore_mask = target == ignore_index
    smooth.masked_fill_(ignore_mask, 0.0)
    if reduction == "mean":
        # The divisor first: the order in which CUDA's (GCC-built) code evaluates the operands.
        if weight is not None:
            filtered = target.masked_fill(ignore_mask, 0)
            weights = weight.gather(0, filtered.flatten()).masked_fill_(ignore_mask.flatten(), 0)
            divisor = weights.sum()
        else:
            divisor = (~ignore_mask).sum()
        ret = smooth.sum() / divisor
    elif reduction == "sum":
        ret = smooth.sum()
    else:
        ret = smooth
    return (1 - smoothing) * nll + ret * (smoothing / n_classes)
