"""The structural levers of a training step as asked, before they are resolved against a
model's names (``ModelProfile.levers`` resolves them into a :class:`Levers`)."""

from __future__ import annotations

import dataclasses


def _frozen(value: object) -> object:
    """Lists of names or patterns as tuples, so that the record stays hashable."""
    if isinstance(value, list):
        return tuple(value)
    return value


@dataclasses.dataclass(frozen=True)
class LeverSettings:
    """Activation checkpointing, trainable subsets, LoRA and gradient accumulation, in the
    forms ``ModelProfile.estimate`` documents for its keywords of the same names.

    Attributes
    ----------
    checkpoint : None, "auto", str or tuple of str
    checkpoint_policy : None, "full", "op", int or callable
        How each checkpointed block is checkpointed: None or ``"full"`` (the whole block
        recomputed), ``"op"`` (torchtitan's op-level selective checkpointing), k (every k-th
        block) or a ``policy(ctx, op, *args, **kwargs)`` for
        ``torch.utils.checkpoint.create_selective_checkpoint_contexts``. Without
        ``checkpoint``, it applies to ``checkpoint="auto"``'s blocks.
    trainable : None, str or tuple of str
    grad_accumulation : int
        Micro-batches per optimizer step.
    lora_rank : int, optional
    lora_targets : "auto", "all-linear" or tuple of str
    lora_dtype : None or str
        The LoRA adapters' dtype (``"fp32"``, ``"bf16"``, ``"fp16"``, or ``"base"`` for the
        base weights' own). None: PEFT's default.
    loss_chunks : int, optional
        The output projection and cross-entropy over this many chunks of the sequence,
        torchtune's ``num_output_chunks`` with its ``CEWithChunkedOutputLoss``: one chunk of
        logits upcast to fp32 at a time. None: the model's own output and loss.
    offload_activations : None, bool or str
        The forward's saved activations offloaded to host memory: None or False (off), True
        or ``"torchtune"`` (torchtune's ``OffloadActivations``, the output projection kept
        on the device), or ``"save_on_cpu"`` (``torch.autograd.graph.save_on_cpu``).
    compile : None, bool or str
        The step as ``torch.compile`` (the default Inductor backend) runs it: None or False
        (eager), True or ``"model"`` (the whole model), ``"blocks"`` (each repeated block
        compiled on its own with ``fullgraph=True``, as torchtitan and torchtune do).
    activation_memory_budget : float, optional
        With ``compile``: ``torch._functorch.config.activation_memory_budget`` in [0, 1],
        the fraction of the default partition's saved activations the partitioner may
        keep. None: its default (1.0).

    Examples
    --------
    >>> LeverSettings(checkpoint=["layer1", "layer2"]).checkpoint
    ('layer1', 'layer2')
    """

    checkpoint: object = None
    trainable: object = None
    grad_accumulation: int = 1
    lora_rank: int | None = None
    lora_targets: object = "auto"
    lora_dtype: str | None = None
    loss_chunks: int | None = None
    checkpoint_policy: object = None
    offload_activations: object = None
    compile: object = None
    activation_memory_budget: float | None = None

    def __post_init__(self) -> None:
        for name in ("checkpoint", "trainable", "lora_targets"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))
