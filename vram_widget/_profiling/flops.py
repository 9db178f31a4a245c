"""FLOPs of one aten op call, from shapes alone.

The counting convention is PyTorch's own ``torch.utils.flop_counter.FlopCounterMode``: two FLOPs
per multiply-add, and only matrix products, convolutions and attention count (elementwise ops,
norms, softmax and reductions are 0). We start from its ``flop_registry`` and correct the places
where it is wrong or silent:

1. CPU flash attention. ``aten._scaled_dot_product_flash_attention_for_cpu`` (what
   ``F.scaled_dot_product_attention`` runs on CPU) and its backward are not registered, so stock
   counts 0 for every attention on CPU.
2. Grouped convolution backward. Stock ``conv_backward_flop`` computes the weight gradient with
   the full input-channel count, ``groups`` times too high (``C`` times for a depthwise conv).
3. Fused transformer inference. ``aten._transformer_encoder_layer_fwd`` (what
   ``nn.TransformerEncoderLayer`` runs in eval under ``no_grad``) and
   ``aten._native_multi_head_attention`` (``nn.MultiheadAttention`` likewise) are not
   registered, so stock counts 0 for a whole transformer encoder at inference.

Only shapes and non-tensor arguments are read, never values, so every function here works on
FakeTensors and meta tensors as well as real ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from math import prod
from typing import Any

import torch
from torch.utils.flop_counter import (
    conv_flop_count,
    flop_registry,
    sdpa_backward_flop_count,
    sdpa_flop_count,
    shape_wrapper,
)

__all__ = ["count_flops", "flops_to_macs", "has_flop_formula", "op_flops"]

aten = torch.ops.aten

# A formula takes the op's (args, kwargs) plus ``out_val=<op output>`` as keywords and returns
# an int: the calling convention of ``FlopCounterMode._count_flops`` in
# torch/utils/flop_counter.py (``flop_count_func(*args, **kwargs, out_val=out)``).
_Formula = Callable[..., int]


def _packet(name: str) -> Any | None:
    """``torch.ops.aten.<name>``, or None where this torch build has no such op."""
    try:
        return getattr(aten, name)
    except (AttributeError, RuntimeError):
        return None


def _shape(t: Any) -> tuple[int, ...]:
    return tuple(t.shape)


# --------------------------------------------------------------------------------------------
# Fix 1: CPU flash attention.
#
# The CPU kernel's schema (native_functions.yaml) is
#   _scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p, is_causal, *,
#       attn_mask, scale) -> (output, logsumexp)
#   _scaled_dot_product_flash_attention_for_cpu_backward(grad_out, query, key, value, out,
#       logsumexp, dropout_p, is_causal, *, attn_mask, scale) -> (grad_query, grad_key, grad_value)
# and all of query/key/value/out/grad_out have the logical (B, H, L, D) layout (only their
# strides differ, which shapes do not see), the same as the CUDA flash op. So the positional
# order matches the registry's ``sdpa_flop`` / ``sdpa_backward_flop`` (query, key, value first;
# grad_out, query, key, value first for the backward), and we reuse those helpers. Like stock we
# do not discount causal masking.
# --------------------------------------------------------------------------------------------


@shape_wrapper
def _sdpa_forward_flop(
    query_shape: Sequence[int],
    key_shape: Sequence[int],
    value_shape: Sequence[int],
    *args: Any,
    out_shape: Any = None,
    **kwargs: Any,
) -> int:
    """Forward SDPA: Q K^T and P V (``sdpa_flop`` in torch/utils/flop_counter.py)."""
    key_shape, value_shape = (_query_heads(query_shape, s) for s in (key_shape, value_shape))
    return int(sdpa_flop_count(query_shape, key_shape, value_shape))


@shape_wrapper
def _sdpa_backward_flop(
    grad_out_shape: Sequence[int],
    query_shape: Sequence[int],
    key_shape: Sequence[int],
    value_shape: Sequence[int],
    *args: Any,
    out_shape: Any = None,
    **kwargs: Any,
) -> int:
    """Backward SDPA: score recompute plus four gradient matmuls (``sdpa_backward_flop``)."""
    key_shape, value_shape = (_query_heads(query_shape, s) for s in (key_shape, value_shape))
    return int(sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape))


def _query_heads(query_shape: Sequence[int], shape: Sequence[int]) -> Sequence[int]:
    """A key or value shape (B, H_kv, S, D) of grouped-query attention with the query's H
    heads: the kernel broadcasts each key/value head to its group of query heads, so the
    matmuls count H heads (torch's ``sdpa_flop_count`` does this itself from 2.12; 2.11's
    asserts equal head counts)."""
    heads, kv_heads = query_shape[1], shape[1]
    if len(shape) == 4 and kv_heads != heads and kv_heads and heads % kv_heads == 0:
        return (shape[0], heads, shape[2], shape[3])
    return shape


# --------------------------------------------------------------------------------------------
# Fix 2: convolution backward with groups.
#
# The weight of a grouped conv is (C_out, C_in/groups, *k) (transposed: (C_in, C_out/groups,
# *k)), so stock ``conv_flop_count`` gets the forward right from the weight shape alone:
#   2 * N * prod(out_spatial) * C_out * (C_in/groups) * prod(k)        (transposed: in_spatial)
# Stock ``conv_backward_flop`` writes grad_weight as a conv over t(input) = (C_in, N, ...), which
# uses all C_in channels against all C_out: ``groups`` times the real work. Each of grad_input
# and grad_weight performs exactly the multiply-adds of the forward (every forward MAC
# x*w contributes one MAC dy*w to grad_input and one MAC dy*x to grad_weight), so each requested
# gradient costs the forward count. For groups == 1 this equals stock's number for both the
# regular and the transposed case (checked in tests/test_flops.py); the bias gradient is a
# reduction and counts 0, as in stock.
# --------------------------------------------------------------------------------------------


@shape_wrapper
def _conv_backward_flop(
    grad_out_shape: Sequence[int],
    x_shape: Sequence[int],
    w_shape: Sequence[int],
    _bias_sizes: Any,
    _stride: Any,
    _padding: Any,
    _dilation: Any,
    transposed: bool,
    _output_padding: Any,
    _groups: int,
    output_mask: Sequence[bool],
    *args: Any,
    out_shape: Any = None,
    **kwargs: Any,
) -> int:
    """Backward of ``aten.convolution``: the forward count once per requested input/weight grad.

    The forward's output shape is ``grad_out_shape``; ``conv_flop_count`` reads the spatial
    extent from it (or from the input for a transposed conv) and the channel product from the
    weight shape, which already carries the ``1/groups``.
    """
    forward = int(conv_flop_count(list(x_shape), list(w_shape), list(grad_out_shape), transposed))
    return forward * (int(bool(output_mask[0])) + int(bool(output_mask[1])))


@shape_wrapper
def _conv_forward_not_transposed_flop(
    x_shape: Sequence[int],
    w_shape: Sequence[int],
    *args: Any,
    out_shape: Any = None,
    **kwargs: Any,
) -> int:
    """Forward of ``cudnn_convolution`` / ``_slow_conv2d_forward``.

    Stock maps these to ``conv_flop``, which reads its 7th positional argument as
    ``transposed``; in these schemas that slot is ``benchmark`` resp. absent/``padding``, so a
    padded conv would be counted over the input's spatial extent. Both are plain convolutions.
    """
    return int(conv_flop_count(list(x_shape), list(w_shape), list(out_shape), transposed=False))


# --------------------------------------------------------------------------------------------
# Fix 3: fused transformer inference kernels.
#
# aten/src/ATen/native/transformers/attention.cpp (native_multi_head_attention_cpu) computes
#   qkv = [query, key, value] @ qkv_weight.T   # qkv_weight: (3E, E); one GEMM for self-attention
#   scores = q @ k^T ; attn = softmax(scores) @ v                         # per head, D = E / H
#   out = attn @ proj_weight.T                 # proj_weight: (E, E)
# and aten/src/ATen/native/transformers/transformer.cpp (transformer_encoder_layer_forward) is
#   x = src (+ layer_norm); x = native_multi_head_attention(x, x, x, ...)[0] + src
#   x = layer_norm(x); x = x + ffn(x)   # ffn: linear(ffn_weight_1) -> act -> linear(ffn_weight_2)
# The non-fused path (training mode, or fastpath disabled) runs the same products as
# addmm/mm + SDPA, so we count exactly what FlopCounterMode counts there (after fix 1).
# --------------------------------------------------------------------------------------------


def _sequences(t: torch.Tensor) -> list[tuple[int, int]]:
    """``(count, length)`` groups of the sequences in a (B, L, E) / (L, E) or nested tensor.

    A dense batch is one group ``(B, L)``. ``nn.TransformerEncoder`` turns a padded batch into a
    nested tensor when it is given a ``src_key_padding_mask``, and the kernel then computes only
    the real tokens: one group ``(1, L_i)`` per sequence. Nested sizes are metadata (a small CPU
    tensor of shapes), not data.
    """
    if t.is_nested:
        sizes = t._nested_tensor_size()  # (B, 2): rows of (L_i, E)
        return [(1, int(row[0])) for row in sizes.tolist()]
    shape = _shape(t)
    return [(prod(shape[:-2]), shape[-2])]  # prod(()) == 1 for an unbatched (L, E)


def _tokens(groups: list[tuple[int, int]]) -> int:
    return sum(count * length for count, length in groups)


def _linear_flop(tokens: int, weight: torch.Tensor) -> int:
    """``tokens`` rows times a (out_features, in_features) weight: 2 * tokens * in * out."""
    out_features, in_features = _shape(weight)
    return 2 * tokens * in_features * out_features


def _mha_flop(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    num_heads: int,
    qkv_weight: torch.Tensor,
    proj_weight: torch.Tensor,
) -> int:
    """In-projection, per-sequence attention and out-projection of a fused MHA call."""
    three_e, embed = _shape(qkv_weight)
    per_proj = three_e // 3
    head_dim = per_proj // num_heads
    q_seqs, k_seqs, v_seqs = (_sequences(t) for t in (query, key, value))
    # The (3E, E) weight is three (E, E) blocks; each of q, k, v goes through one block.
    flops = sum(2 * _tokens(seqs) * embed * per_proj for seqs in (q_seqs, k_seqs, v_seqs))
    # Attention per group of equal-length sequences, as SDPA over (count, H, L, D).
    for (count, len_q), (_, len_k) in zip(q_seqs, k_seqs, strict=True):
        q_shape = (count, num_heads, len_q, head_dim)
        kv_shape = (count, num_heads, len_k, head_dim)
        flops += int(sdpa_flop_count(q_shape, kv_shape, kv_shape))
    return flops + _linear_flop(_tokens(q_seqs), proj_weight)


def _native_mha_flop(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    embed_dim: int,
    num_head: int,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor,
    proj_weight: torch.Tensor,
    *args: Any,
    out_val: Any = None,
    **kwargs: Any,
) -> int:
    """``aten._native_multi_head_attention`` (schema order: query, key, value, embed_dim,
    num_head, qkv_weight, qkv_bias, proj_weight, proj_bias, mask, need_weights, ...)."""
    return _mha_flop(query, key, value, num_head, qkv_weight, proj_weight)


def _transformer_encoder_layer_flop(
    src: torch.Tensor,
    embed_dim: int,
    num_heads: int,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor,
    proj_weight: torch.Tensor,
    proj_bias: torch.Tensor,
    use_gelu: bool,
    norm_first: bool,
    eps: float,
    norm_weight_1: torch.Tensor,
    norm_bias_1: torch.Tensor,
    norm_weight_2: torch.Tensor,
    norm_bias_2: torch.Tensor,
    ffn_weight_1: torch.Tensor,
    ffn_bias_1: torch.Tensor,
    ffn_weight_2: torch.Tensor,
    *args: Any,
    out_val: Any = None,
    **kwargs: Any,
) -> int:
    """``aten._transformer_encoder_layer_fwd``: self-attention plus the two FFN linears."""
    tokens = _tokens(_sequences(src))
    return (
        _mha_flop(src, src, src, num_heads, qkv_weight, proj_weight)
        + _linear_flop(tokens, ffn_weight_1)
        + _linear_flop(tokens, ffn_weight_2)
    )


# The oneDNN RNN layer (CPU nn.LSTM / nn.GRU / nn.RNN).


def _rnn_layer_forward_flop(
    inp: torch.Tensor,
    weight0: torch.Tensor,
    weight1: torch.Tensor,
    *args: Any,
    out_val: Any = None,
    **kwargs: Any,
) -> int:
    """``aten.mkldnn_rnn_layer``: at every step, the input and hidden projections of all gates,
    ``x @ W_ih.T`` and ``h @ W_hh.T``; the same matmuls an unrolled cell runs (2 FLOPs per MAC).

    ``weight0`` is (gates * hidden, input) and ``weight1`` (gates * hidden, hidden), so the
    gate count needs no lookup here."""
    steps_times_batch = math.prod(_shape(inp)[:-1])  # (T, B, I) or (B, T, I)
    w_ih, w_hh = _shape(weight0), _shape(weight1)
    return 2 * steps_times_batch * (w_ih[0] * w_ih[1] + w_hh[0] * w_hh[1])


def _rnn_layer_backward_flop(
    inp: torch.Tensor,
    weight1: torch.Tensor,
    weight2: torch.Tensor,
    *args: Any,
    out_val: Any = None,
    **kwargs: Any,
) -> int:
    """``aten.mkldnn_rnn_layer_backward``: each forward matmul has two gradient matmuls (its
    input's and its weight's), as autograd of the unrolled cell computes."""
    return 2 * _rnn_layer_forward_flop(inp, weight1, weight2)


# --------------------------------------------------------------------------------------------
# The table: stock registry, then our corrections (later entries win).
# --------------------------------------------------------------------------------------------


def _build_formulas() -> dict[Any, _Formula]:
    formulas: dict[Any, _Formula] = dict(flop_registry)
    overrides: dict[str, _Formula] = {
        # Fix 1. The CUDA/XPU fused SDPA variants are already in stock; listed again so that an
        # older torch that lacks one still gets it (same formulas as stock's sdpa_flop).
        "_scaled_dot_product_flash_attention_for_cpu": _sdpa_forward_flop,
        "_scaled_dot_product_flash_attention_for_cpu_backward": _sdpa_backward_flop,
        "_scaled_dot_product_flash_attention": _sdpa_forward_flop,
        "_scaled_dot_product_flash_attention_backward": _sdpa_backward_flop,
        "_scaled_dot_product_efficient_attention": _sdpa_forward_flop,
        "_scaled_dot_product_efficient_attention_backward": _sdpa_backward_flop,
        "_scaled_dot_product_cudnn_attention": _sdpa_forward_flop,
        "_scaled_dot_product_cudnn_attention_backward": _sdpa_backward_flop,
        # Out-of-tree backends (XPU, PrivateUse1) route SDPA here; not in stock. Its backward's
        # first four arguments are grad_out, query, key, value as well.
        "_scaled_dot_product_fused_attention_overrideable": _sdpa_forward_flop,
        "_scaled_dot_product_fused_attention_overrideable_backward": _sdpa_backward_flop,
        # Fix 2.
        "convolution_backward": _conv_backward_flop,
        "cudnn_convolution": _conv_forward_not_transposed_flop,
        "_slow_conv2d_forward": _conv_forward_not_transposed_flop,
        # Fix 3.
        "_native_multi_head_attention": _native_mha_flop,
        "_transformer_encoder_layer_fwd": _transformer_encoder_layer_flop,
        # CPU recurrent layers (stock counts 0 for nn.LSTM on the CPU).
        "mkldnn_rnn_layer": _rnn_layer_forward_flop,
        "mkldnn_rnn_layer_backward": _rnn_layer_backward_flop,
    }
    for name, formula in overrides.items():
        packet = _packet(name)
        if packet is not None:
            formulas[packet] = formula
    # LLM.int8's matmul (weights="int8"): torch._int_mm on the CPU, bitsandbytes' own
    # int8_linear_matmul on CUDA (backends/cuda/ops.py); stock counts neither
    packet = _packet("_int_mm")
    if packet is not None:
        formulas[packet] = _int8_matmul_flop
    # torchao's int4 on the CPU (weights="int4-torchao": Int4OpaqueTensor's linear); stock
    # counts 0 for it
    packet = _packet("_weight_int4pack_mm_for_cpu")
    if packet is not None:
        formulas[packet] = _int4_cpu_matmul_flop
    return formulas


def count_bitsandbytes_matmuls() -> None:
    """Count bitsandbytes' ``int8_linear_matmul`` (its ops exist once it is imported)."""
    _FORMULAS[torch.ops.bitsandbytes.int8_linear_matmul] = _int8_matmul_flop


@shape_wrapper
def _int8_matmul_flop(
    a_shape: Sequence[int], b_shape: Sequence[int], *args: Any, **kwargs: Any
) -> int:
    """``A @ B.t()`` for ``int8_linear_matmul(A (..., K), B (N, K))``, or ``A @ B`` for
    ``_int_mm(A (M, K), B (K, N))``: 2 per multiply-add."""
    k = a_shape[-1]
    n = b_shape[0] if b_shape[-1] == k and b_shape[0] != k else b_shape[-1]
    return 2 * prod(a_shape[:-1]) * k * n


@shape_wrapper
def _int4_cpu_matmul_flop(
    a_shape: Sequence[int], b_shape: Sequence[int], *args: Any, **kwargs: Any
) -> int:
    """``_weight_int4pack_mm_for_cpu(A (M, K), B, group_size, scales_and_zeros)``: ``A``
    times the unpacked ``(N, K)`` weight transposed, B being its ``(N, K / 2)`` uint8
    packing (two 4-bit values a byte, ``_convert_weight_to_int4pack_for_cpu``): 2 per
    multiply-add, ``2 * M * N * K``."""
    return 2 * prod(a_shape[:-1]) * a_shape[-1] * b_shape[0]


_FORMULAS: dict[Any, _Formula] = _build_formulas()


def _key(func: Any) -> Any:
    # An OpOverload (aten.mm.default) is looked up by its packet (aten.mm), as FlopCounterMode
    # does; higher-order operators (flex_attention) are registry keys themselves.
    return getattr(func, "_overloadpacket", func)


def has_flop_formula(func: Any) -> bool:
    """Whether ``op_flops`` has a formula for ``func`` (an ``OpOverload`` or packet).

    A dispatch mode that sees an op without a formula should try ``func.decompose(...)`` first,
    as ``FlopCounterMode.__torch_dispatch__`` does: under ``torch.inference_mode()`` composite
    ops such as ``aten.linear`` reach the mode undecomposed, and their matmuls only become
    visible once decomposed.
    """
    return _key(func) in _FORMULAS


def op_flops(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    """FLOPs of one call ``out = func(*args, **kwargs)``.

    Parameters
    ----------
    func
        The ``torch._ops.OpOverload`` that ran (e.g. ``torch.ops.aten.mm.default``).
    args, kwargs
        Its arguments as the dispatcher passed them: real, fake or meta tensors; only their
        shapes are read.
    out
        Its return value (some formulas, e.g. convolution, read the output shape).

    Returns
    -------
    int
        Two FLOPs per multiply-add for matmul-like ops, convolutions and attention, as
        ``torch.utils.flop_counter.FlopCounterMode`` counts (with the corrections listed in the
        module docstring); 0 for every other op.
    """
    formula = _FORMULAS.get(_key(func))
    if formula is None:
        return 0
    return int(formula(*args, **(kwargs or {}), out_val=out))


def flops_to_macs(flops: int) -> int:
    """Multiply-accumulates from FLOPs (``flops // 2``).

    thop, torchinfo, fvcore and the cs231n notes count one multiply-add as one operation; PyTorch
    and this package count it as two FLOPs.
    """
    return int(flops) // 2


def count_flops(fn: Callable[[], Any]) -> int:
    """Run ``fn()`` and return the FLOPs of every aten op it dispatched, backward included.

    Parameters
    ----------
    fn
        A no-argument callable, e.g. ``lambda: model(x).sum().backward()``. Its return value is
        discarded.

    Returns
    -------
    int
        The sum of :func:`op_flops` over all ops ``fn`` ran (ops without a formula are first
        decomposed where they can be, mirroring ``FlopCounterMode``).
    """
    from .fake import TorchDispatchMode

    class _FlopSum(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.total = 0

        def __torch_dispatch__(
            self,
            func: Any,
            types: Any,
            args: tuple[Any, ...] = (),
            kwargs: dict[str, Any] | None = None,
        ) -> Any:
            kwargs = kwargs or {}
            # Same order as FlopCounterMode.__torch_dispatch__ (torch/utils/flop_counter.py):
            # a composite op without a formula (aten.linear under inference_mode) is decomposed
            # under this mode, so the mm/addmm it becomes is counted; counting both would double.
            if not has_flop_formula(func) and func is not torch.ops.prim.device.default:
                with self:
                    result = func.decompose(*args, **kwargs)
                if result is not NotImplemented:
                    return result
            out = func(*args, **kwargs)
            self.total += op_flops(func, args, kwargs, out)
            return out

    mode = _FlopSum()
    with mode:
        fn()
    return mode.total
