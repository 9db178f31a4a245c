"""One context-parallel rank's step: the model at ``seq_len / cp`` tokens on a fake process
group of ``cp`` ranks, with PyTorch's own ring attention in place of
``F.scaled_dot_product_attention``.

What torch 2.13 runs (``torch/distributed/tensor/experimental/_context_parallel/
_attention.py``; checked on this CPU build):

* ``context_parallel(mesh, buffers=..., buffer_seq_dims=...)`` shards each buffer along the
  sequence (``_context_parallel_buffers``; head-tail load balancing where the length is a
  multiple of ``2 * cp``, ``_load_balancer.py`` ``_create_default_load_balancer``) and patches
  ``F.scaled_dot_product_attention`` to wrap q, k and v as DTensors sharded on dim 2
  (``_ContextParallel.sdpa_input_fn``). DTensor then hands three SDPA ops to the ring
  (``custom_ops``: ``_scaled_dot_product_flash_attention``, ``_efficient_attention`` and
  ``_cudnn_attention``, forward and backward; ``_sdpa_handler``): no other.
* ``_templated_ring_attention`` runs the op once per K/V block, ``cp`` times: each step
  concatenates the local K and V into one flat buffer (``torch.cat([key.flatten(),
  value.flatten()])``), the all-gather rotater gathers it from every rank once
  (``_AllGatherRotater``, the default ``_cp_options.rotate_method``: ``cp`` x the local
  K+V), and ``_SDPAMerger`` merges each block's output and logsumexp in fp32
  (``convert_to_f32=True``). Autograd keeps the op's inputs and its merged output and
  logsumexp, as for one SDPA call; the backward (``_templated_ring_attention_backward``)
  accumulates dq, dk, dv in fp32 and rotates dK+dV with all-to-all.
* On a CPU device SDPA dispatches ``aten._scaled_dot_product_flash_attention_for_cpu``,
  which is not among those ops and has no DTensor sharding strategy: the real CPU step
  raises ``NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.
  default does not have a sharding strategy registered`` (on fake and on gloo ranks alike).
  Context parallelism runs on CUDA only, so it is estimated for ``device="cuda"`` profiles:
  their CPU fake tensors call the backend op CUDA would pick (``cuda_kernels.sdpa_kernel``),
  which the ring then runs on the local blocks through its meta kernel. What the ring
  allocates is what torch's code allocates; the CUDA kernels' own workspaces are those the
  emulation models. It is UNCONFIRMED against a real CUDA run (docs/known-gaps.md).
* The backend is chosen on the DTensors' whole-sequence shapes (``attention.cpp ·
  scaled_dot_product_attention`` calls ``_fused_sdp_choice_stub`` with the DTensor query), and
  two choices cannot run the ring, so a real step raises; ``ring_refusal`` names them at the
  first attention call, before it runs (``cuda_kernels.sdpa_backend_checked``):

  - *math*: fp32 attention with grouped-query heads (Hugging Face passes the fewer key/value
    heads with ``enable_gqa=True``, ``transformers/integrations/sdpa_attention.py ·
    use_gqa_in_sdpa``): flash and cuDNN take fp16/bf16 only and mem-efficient refuses
    grouped-query heads (``cuda/sdp_utils.cpp · can_use_mem_efficient_attention``,
    ``check_batch_size_and_num_heads_dense<false>``). The math composite is no ring op; with
    ``is_causal`` it builds its mask as a plain tensor (``attention.cpp ·
    _scaled_dot_product_attention_math``, ``at::ones_symint({L, S}, ...).tril()``) and adds
    it to the DTensor scores: ``aten.add.Tensor got mixed torch.Tensor and DTensor``.
  - *mem-efficient* (fp32 with equal heads): its logsumexp rows are padded to a multiple of 32
    (``cuda/attention.cu · _efficient_attention_forward``, ``kAlignLSE``; the same in
    ``torch/_meta_registrations.py · meta__scaled_dot_product_efficient_attention``), while
    ``_SDPAMerger._merge_one`` combines each block's logsumexp with its unpadded output rows
    and ``_partial_update`` halves it: every q block the ring runs must be a multiple of 32
    rows (the local sequence and, load-balanced, its half), or the step raises a broadcast
    error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from .._estimating.options import Device
from .cuda_kernels import sdpa_backend_checked
from .cuda_sdpa import SdpaBackend

_HALF = (torch.float16, torch.bfloat16)

# the mem-efficient kernel's logsumexp row alignment (cuda/attention.cu, kAlignLSE)
_EFFICIENT_LSE_ROWS = 32

# the SDPA forward ops context parallelism hands to its ring (_attention.py, custom_ops)
_RING_FORWARD_OPS = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)


def check_context_parallel_model(
    model: torch.nn.Module, input_names: list[str], device: Device
) -> None:
    """A ValueError where ``model`` (with inputs named ``input_names``) cannot run torch's
    ring attention, before any profiling: a CPU profile, attention other than SDPA, a mask.

    Examples
    --------
    >>> check_context_parallel_model(torch.nn.Linear(2, 2), ["x"], Device.CPU)
    Traceback (most recent call last):
    ...
    ValueError: cp > 1 is estimated for device='cuda' profiles only: ...
    """
    if device is Device.CPU:
        raise ValueError(
            "cp > 1 is estimated for device='cuda' profiles only: on a CPU device SDPA runs "
            "aten._scaled_dot_product_flash_attention_for_cpu, which torch's context "
            "parallelism does not handle (only the flash, efficient and cuDNN ops, "
            "torch/distributed/tensor/experimental/_context_parallel/_attention.py custom_ops): "
            "a real CPU step raises NotImplementedError; profile with device='cuda'"
        )
    config = getattr(model, "config", None)
    attention = getattr(config, "_attn_implementation", None)
    if config is not None and attention not in (None, "sdpa"):
        raise ValueError(
            f"cp > 1 with attn_implementation={attention!r}: torch's context parallelism "
            "replaces F.scaled_dot_product_attention only (eager attention computes its "
            "scores itself and would attend within each rank's shard); load the model with "
            "attn_implementation='sdpa'"
        )
    masks = [name for name in input_names if "mask" in name]
    if masks:
        raise ValueError(
            f"cp > 1 with the input {masks[0]!r}: a mask reaches SDPA as attn_mask, which "
            "the flash op cannot take and the ring's efficient and cuDNN ops refuse "
            "('attn_bias is not supported yet', _context_parallel/_attention.py "
            "_scaled_dot_product_ring_efficient_attention); context parallelism shards "
            "causal (is_causal=True) or unmasked attention only: leave the mask out"
        )


def local_length(seq_len: int, cp: int) -> int:
    """Each rank's tokens: ``seq_len / cp`` (cp divides it, ``check_context_parallel``).

    Examples
    --------
    >>> local_length(4096, 4)
    1024
    """
    return seq_len // cp


class RingRefusal(ValueError):
    """An attention call torch's ring cannot run, named before it runs (``ring_refusal``)."""


def _load_balanced(is_causal: bool) -> bool:
    # the ring halves q and the merged logsumexp where load balancing is on and the attention
    # is causal (_attention.py · _templated_ring_attention; _cp_options.enable_load_balance,
    # True by default)
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    return bool(_cp_options.enable_load_balance) and is_causal


def ring_refusal(
    cp: int,
    backend: SdpaBackend,
    query: torch.Tensor,
    key: torch.Tensor,
    is_causal: bool,
) -> str | None:
    """Why torch's ring attention over ``cp`` ranks cannot run an SDPA call that picked
    ``backend`` for ``query`` and ``key`` (their whole-sequence shapes, ``(B, H, S, D)``),
    or None (module docstring).

    Examples
    --------
    >>> q = torch.empty(2, 4, 32, 16, device="meta")
    >>> kv = torch.empty(2, 2, 32, 16, device="meta")
    >>> print(ring_refusal(2, SdpaBackend.MATH, q, kv, True)[:53])
    cp=2: this attention runs SDPA's math backend on CUDA
    >>> ring_refusal(2, SdpaBackend.FLASH, q, kv, True) is None
    True
    """
    dtype = str(query.dtype).removeprefix("torch.")
    heads_q, heads_kv, head_dim = query.size(1), key.size(1), query.size(-1)
    seq = query.size(-2)
    shape = f"{dtype}, {heads_q} query heads over {heads_kv} key/value heads, head dim {head_dim}"
    if backend is SdpaBackend.MATH:
        why = "flash and cuDNN take fp16/bf16 only" if query.dtype not in _HALF else ""
        if heads_q != heads_kv:
            why += (", and " if why else "") + (
                "mem-efficient refuses grouped-query heads (enable_gqa)"
            )
        failure = (
            "the real step raises 'aten.add.Tensor got mixed torch.Tensor and DTensor' (the math "
            "composite adds its causal mask, a plain tensor, to the DTensor scores: "
            "attention.cpp _scaled_dot_product_attention_math)"
            if is_causal
            else "the ring never runs it"
        )
        return (
            f"cp={cp}: this attention runs SDPA's math backend on CUDA ({shape}"
            f"{'; ' + why if why else ''}; aten/src/ATen/native/transformers/cuda/sdp_utils.cpp), "
            "which torch's context parallelism does not shard (it hands only the flash, "
            "mem-efficient and cuDNN ops to its ring, _context_parallel/_attention.py "
            f"custom_ops): {failure}; use precision 'bf16' or 'amp-bf16' (flash attention)"
        )
    if backend is SdpaBackend.EFFICIENT:
        local = seq // cp
        blocks = [local, local // 2] if _load_balanced(is_causal) else [local]
        if all(rows % _EFFICIENT_LSE_ROWS == 0 for rows in blocks) and local % len(blocks) == 0:
            return None
        multiple = _EFFICIENT_LSE_ROWS * len(blocks) * cp
        return (
            f"cp={cp} with seq_len={seq}: this attention runs SDPA's mem-efficient kernel on "
            f"CUDA ({shape}), whose logsumexp rows are padded to a multiple of "
            f"{_EFFICIENT_LSE_ROWS} (cuda/attention.cu, kAlignLSE), and torch's ring merges "
            "each block's logsumexp with its unpadded output (_context_parallel/_attention.py "
            f"_SDPAMerger): each rank's {local} tokens run as q blocks of "
            f"{' and '.join(map(str, blocks))} rows, which must be multiples of "
            f"{_EFFICIENT_LSE_ROWS}, or the real step raises a broadcast error; use a seq_len "
            f"that is a multiple of {multiple}, or precision 'bf16' or 'amp-bf16' (flash "
            "attention)"
        )
    return None


def _refusing(cp: int) -> Any:
    def check(
        backend: SdpaBackend,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        is_causal: bool,
        enable_gqa: bool,
    ) -> None:
        reason = ring_refusal(cp, backend, query, key, is_causal)
        if reason is not None:
            raise RingRefusal(reason)

    return check


def ring_refusal_in(exc: BaseException) -> RingRefusal | None:
    """The ``RingRefusal`` an error of the profiled step was raised from, or None."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, RingRefusal):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


@contextlib.contextmanager
def ring_attention(mesh: Any, seq_len: int) -> Iterator[list[str]]:
    """``context_parallel`` on ``mesh`` for a sequence of ``seq_len`` tokens (a stand-in
    buffer of that length sets the load balancing as the real inputs would); yields the
    list of SDPA ops the ring runs, appended as they run."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental import context_parallel

    ran: list[str] = []
    positions = torch.arange(seq_len).unsqueeze(0)
    with context_parallel(mesh, buffers=[positions], buffer_seq_dims=[1]):
        # context_parallel sets DTensor's custom handlers on entry and restores them on exit
        # (_enable_cp_dtensor_dispatcher / _disable_cp_dtensor_dispatcher): counted here
        handlers = DTensor._op_dispatcher._custom_op_handlers
        counted = dict(handlers)
        for name in _RING_FORWARD_OPS:
            op = getattr(torch.ops.aten, name).default
            if op in handlers:
                counted[op] = _counting(handlers[op], name, ran)
        DTensor._op_dispatcher._custom_op_handlers = counted
        with sdpa_backend_checked(_refusing(mesh.size())):
            yield ran


def _counting(handler: Any, name: str, ran: list[str]) -> Any:
    def counted(*args: Any, **kwargs: Any) -> Any:
        ran.append(name)
        return handler(*args, **kwargs)

    return counted


def no_ring_refusal(cp: int) -> str:
    """Why a step whose attention the ring never ran is refused."""
    return (
        f"cp={cp}: the model's step ran no F.scaled_dot_product_attention that torch's context "
        "parallelism shards (the flash, efficient or cuDNN kernel, _context_parallel/"
        "_attention.py custom_ops): attention written out (matmul, softmax), or SDPA on the "
        "math backend, would attend within each rank's shard only; use SDPA attention on a "
        "GPU and precision that pick a fused kernel"
    )
