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
  their CPU fake tensors call the backend op CUDA would pick (``cuda_rules._sdpa_kernel``),
  which the ring then runs on the local blocks through its meta kernel. What the ring
  allocates is what torch's code allocates; the CUDA kernels' own workspaces are those the
  emulation models. It is UNCONFIRMED against a real CUDA run (docs/known-gaps.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from .._estimating.options import Device

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
