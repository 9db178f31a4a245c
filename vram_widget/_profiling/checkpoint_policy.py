"""Selective activation checkpointing, applied to a model the way torchtitan applies it:
``checkpoint_policy`` (``_estimating/checkpoint_policy.py``) around the blocks ``checkpoint=``
resolved to. The profiler applies it to the fake model and ``measure()`` to its real copy,
by this one function, so the estimate and the measurement run the same checkpoints.

* ``"op"``: torchtitan 0.3.0's ``SelectiveAC._wrap_block``
  (torchtitan/distributed/activation_checkpoint.py): each block inside
  ``ptd_checkpoint_wrapper(module, context_fn=lambda:
  create_selective_checkpoint_contexts(_get_custom_policy()), preserve_rng_state=True,
  determinism_check="default", early_stop=False, debug=False)`` (the ``Config`` defaults).
  torchtitan is not importable here (it needs its own config stack: tyro, spmd_types), so its
  policy and save list (``_get_default_save_ops``) are reproduced below, line for line.
* an int k: torchtitan 0.2.0's ``_apply_layer_sac`` (same file): every k-th block inside
  ``ptd_checkpoint_wrapper(module, preserve_rng_state=False, early_stop=False)`` (its
  ``ActivationCheckpoint.early_stop`` default, torchtitan/config/job_config.py), the
  others left as they are. torchtitan 0.3.0 dropped this option.
* a callable: ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False,
  context_fn=lambda: create_selective_checkpoint_contexts(policy))`` with torch's other
  defaults, as torch's documentation of ``create_selective_checkpoint_contexts`` writes it.

On a Hugging Face model whose ``checkpoint="auto"`` is its own ``activation_checkpointing_
enable``, that call is made (it also turns the cache off in checkpointed layers and makes the
inputs require grad), and each layer's ``_gradient_checkpointing_func`` then carries the
policy's ``checkpoint`` keywords; with k, the layers not picked have their
``gradient_checkpointing`` flag off.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from .._estimating.checkpoint_policy import CheckpointPolicyName, every_kth_block
from .._estimating.levers import Levers

__all__ = [
    "CheckpointPolicyError",
    "CheckpointPolicyWarning",
    "apply_checkpoint_policy",
    "torchtitan_op_policy",
    "torchtitan_save_ops",
]


class CheckpointPolicyError(ValueError):
    """``checkpoint_policy="op"`` on a block that runs no op it saves."""


class CheckpointPolicyWarning(UserWarning):
    """A callable ``checkpoint_policy`` saved no op's output in a block's forward: that
    block is recomputed whole, as with ``checkpoint_policy="full"``."""


# torchtitan 0.3.0, SelectiveAC.Config.force_recompute_mm_shapes_by_fqns's default
_FORCE_RECOMPUTE_FQNS = ("moe.router.gate",)


def _resolve(root: Any, path: str) -> Any | None:
    """``root.a.b.c`` or None where a part is not registered (torchtitan's ``_resolve_ops``
    skips such ops silently)."""
    obj = root
    try:
        for part in path.split("."):
            obj = getattr(obj, part)
    except (AttributeError, RuntimeError):
        return None
    return obj


@functools.cache
def torchtitan_save_ops() -> frozenset[Any]:
    """The ops whose outputs torchtitan's op-level policy saves: torchtitan 0.3.0's
    ``_get_default_save_ops`` (torchtitan/distributed/activation_checkpoint.py): the
    compute-intensive ops of torch's own partitioner (``torch._functorch.partitioners.
    get_default_op_list().compute_intensive_ops``: mm, addmm, bmm, convolution, SDPA's flash
    and efficient kernels, ...), SDPA's other variants, ``max``, flex attention, ``linear``,
    ``topk``, and the collectives ``reduce_scatter_tensor`` and ``all_to_all_single``.

    Examples
    --------
    >>> ops = torchtitan_save_ops()
    >>> torch.ops.aten.mm.default in ops, torch.ops.aten.relu.default in ops
    (True, False)
    """
    from torch._functorch.partitioners import get_default_op_list

    compute_intensive: Any = get_default_op_list().compute_intensive_ops
    ops: set[Any] = {op.default for op in compute_intensive}
    aten, higher = torch.ops.aten, torch._higher_order_ops
    specs = [
        (aten, "_scaled_dot_product_cudnn_attention.default"),
        (aten, "_scaled_dot_product_attention_math.default"),
        (aten, "_scaled_dot_product_fused_attention_overrideable.default"),
        (aten, "max.default"),
        (higher, "flex_attention"),
        (aten, "linear.default"),
        (aten, "topk.default"),
        (higher, "inductor_compiled_code"),
        (torch.ops, "torch_attn._varlen_attn.default"),
        (torch.ops, "_c10d_functional.reduce_scatter_tensor.default"),
        (torch.ops, "_c10d_functional.all_to_all_single.default"),
        (torch.ops, "deepep.dispatch.default"),
        (torch.ops, "deepep.combine.default"),
        (torch.ops, "hybridep.dispatch.default"),
        (torch.ops, "hybridep.combine.default"),
    ]
    for root, path in specs:
        op = _resolve(root, path)
        if op is not None:
            ops.add(op)
    return frozenset(ops)


def _mm_recompute_shapes(block: torch.nn.Module, base_fqn: str) -> set[torch.Size]:
    """The weight shapes (in, out) whose matmuls torchtitan always recomputes: those of the
    block's ``nn.Linear``s whose qualified name holds ``"moe.router.gate"``
    (``SelectiveAC._wrap_block``)."""
    shapes: set[torch.Size] = set()
    for module_fqn, sub in block.named_modules():
        fqn = f"{base_fqn}.{module_fqn}" if base_fqn else module_fqn
        if not any(f in fqn for f in _FORCE_RECOMPUTE_FQNS):
            continue
        if not isinstance(sub, torch.nn.Linear):
            raise CheckpointPolicyError(
                f"checkpoint_policy='op': torchtitan recomputes the matmuls of the nn.Linear "
                f"named like {_FORCE_RECOMPUTE_FQNS[0]!r}, and {fqn!r} is a "
                f"{type(sub).__name__}: checkpoint_policy='full' or a callable policy instead"
            )
        out_f, in_f = sub.weight.shape
        shapes.add(torch.Size((in_f, out_f)))
    return shapes


def torchtitan_op_policy(
    mm_recompute_shapes: set[torch.Size] | frozenset[torch.Size] = frozenset(),
) -> Callable[..., CheckpointPolicy]:
    """A fresh policy of torchtitan 0.3.0's ``SelectiveAC`` (``_get_custom_policy``'s
    ``wrapped_policy``, torchtitan/distributed/activation_checkpoint.py), one per checkpoint
    call as its ``context_fn`` makes one: save the outputs of :func:`torchtitan_save_ops`,
    except every second ``mm`` / ``linear`` (counted apart in the forward and in the
    recompute; ``addmm`` and ``bmm`` are saved, not counted), and a CUDA-to-CPU copy.

    Examples
    --------
    >>> from types import SimpleNamespace
    >>> policy, fwd = torchtitan_op_policy(), SimpleNamespace(is_recompute=False)
    >>> x = torch.ones(2, 2)
    >>> [policy(fwd, torch.ops.aten.mm.default, x, x).name for _ in range(3)]
    ['MUST_SAVE', 'PREFER_RECOMPUTE', 'MUST_SAVE']
    >>> policy(fwd, torch.ops.aten.relu.default, x).name
    'PREFER_RECOMPUTE'
    """
    save_ops = torchtitan_save_ops()
    mm_ops = (torch.ops.aten.mm.default, torch.ops.aten.linear.default)
    meta = {"forward_mm_count": 0, "recompute_mm_count": 0}

    def wrapped_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if (
            func == torch.ops.aten._to_copy.default
            and "cuda" in str(args[0].device)
            and "device" in kwargs
            and str(kwargs["device"]) == "cpu"
        ):
            return CheckpointPolicy.MUST_SAVE
        mode = "recompute" if ctx.is_recompute else "forward"
        mm_count_key = f"{mode}_mm_count"
        if func in mm_ops:
            weight_shape = args[1].shape
            if func == torch.ops.aten.linear.default:  # (out, in) -> (in, out), as mm's
                weight_shape = torch.Size((weight_shape[1], weight_shape[0]))
            if weight_shape in mm_recompute_shapes:
                return CheckpointPolicy.PREFER_RECOMPUTE
            meta[mm_count_key] += 1
        if func in save_ops:
            if func in mm_ops and meta[mm_count_key] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return wrapped_policy


_SAVES = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE, True)


class _Tally:
    """Whether a policy saved any op's output during one block's forward."""

    def __init__(self, policy: Callable[..., Any]) -> None:
        self.policy = policy
        self.saved = False

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        decision = self.policy(ctx, func, *args, **kwargs)
        if not ctx.is_recompute and any(decision is s for s in _SAVES):
            self.saved = True
        return decision


class _Applied:
    """What one application of a policy to a model tells its blocks: which policy, and
    whether a callable's empty forward was warned about already."""

    def __init__(self, policy: object, compiled: bool = False) -> None:
        self.policy = policy
        self.warned = False
        self.compiled = compiled

    def context_fn(
        self, block_name: str, block: torch.nn.Module, make_policy: Callable[[], Any]
    ) -> Callable[[], tuple[Any, Any]]:
        if self.compiled:
            # inside a compiled region dynamo traces the checkpoint, and its context_fn must
            # give the two TorchDispatchModes themselves (torch/utils/checkpoint.py,
            # _checkpoint_without_reentrant_generator: "In torch.compile mode, `context_fn`
            # ... must generate a tuple of two `TorchDispatchMode`s"):
            # the policy as torchtitan passes it, without the check that it saved anything
            return lambda: create_selective_checkpoint_contexts(make_policy())

        def contexts() -> tuple[Any, Any]:
            tally = _Tally(make_policy())
            forward, recompute = create_selective_checkpoint_contexts(tally)
            return self._checked(forward, tally, block_name, block), recompute

        return contexts

    @contextlib.contextmanager
    def _checked(
        self, forward: Any, tally: _Tally, block_name: str, block: torch.nn.Module
    ) -> Iterator[None]:
        with forward:
            yield
        if tally.saved:
            return
        what = f"{block_name!r} ({type(block).__name__})"
        if self.policy is CheckpointPolicyName.OP:
            raise CheckpointPolicyError(
                "checkpoint_policy='op' saves the outputs of the matmuls, attention and other "
                "ops in torchtitan's save list (every second mm recomputed), and the forward "
                f"of {what} ran none of them: nothing of it would be saved. Checkpoint "
                "blocks that hold matmuls (checkpoint=...), or use checkpoint_policy='full'"
            )
        if not self.warned:
            self.warned = True
            name = getattr(self.policy, "__qualname__", type(self.policy).__name__)
            warnings.warn(
                f"checkpoint_policy={name} returned neither MUST_SAVE nor PREFER_SAVE for any "
                f"op in the forward of {what}: that block is recomputed whole, as with "
                "checkpoint_policy='full'",
                CheckpointPolicyWarning,
                stacklevel=2,
            )


def _block_settings(
    levers: Levers, applied: _Applied, name: str, block: torch.nn.Module
) -> dict[str, Any]:
    """The ``checkpoint`` keywords of one checkpointed block (see the module docstring)."""
    policy = levers.checkpoint_policy
    if isinstance(policy, int):
        return {"preserve_rng_state": False, "early_stop": False}
    if policy is CheckpointPolicyName.OP:
        shapes = _mm_recompute_shapes(block, name)
        return {
            "context_fn": applied.context_fn(
                name, block, functools.partial(torchtitan_op_policy, shapes)
            ),
            "preserve_rng_state": True,
            "determinism_check": "default",
            "early_stop": False,
            "debug": False,
        }
    assert callable(policy)
    return {"context_fn": applied.context_fn(name, block, lambda: policy)}


def apply_checkpoint_policy(
    model: torch.nn.Module,
    levers: Levers,
    enable_hf: Callable[[torch.nn.Module], None],
) -> None:
    """Checkpoint ``levers.checkpoint``'s blocks of ``model`` (in place) by
    ``levers.checkpoint_policy``, as the module docstring says; ``enable_hf`` is Hugging
    Face's own checkpointing call, made where ``levers.checkpoint_hf``."""
    policy = levers.checkpoint_policy
    assert policy is not CheckpointPolicyName.FULL
    blocks = levers.checkpoint
    chosen = set(every_kth_block(blocks, policy) if isinstance(policy, int) else blocks)
    modules = dict(model.named_modules())
    applied = _Applied(policy, compiled=levers.compile is not None)
    if levers.checkpoint_hf:
        enable_hf(model)
        for name in blocks:
            layer = modules[name]
            if name not in chosen:
                layer.gradient_checkpointing = False
                continue
            settings = _block_settings(levers, applied, name, layer)
            layer._gradient_checkpointing_func = functools.partial(
                checkpoint, use_reentrant=False, **settings
            )
        return
    for name in blocks:
        if name not in chosen:
            continue
        block = modules[name]
        parent_name, _, child = name.rpartition(".")
        settings = _block_settings(levers, applied, name, block)
        modules[parent_name]._modules[child] = checkpoint_wrapper(
            block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **settings
        )
