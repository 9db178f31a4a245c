"""Memory levers: which modules recompute their forward (activation checkpointing), which
parameters train, and how many micro-batches accumulate before one optimizer step.

No torch here. A :class:`Levers` is the canonical, hashable form of what a user asked for
(``checkpoint="auto"``, ``trainable="lm_head.*"``, ``grad_accumulation=4``), resolved
against the profiled model's module and parameter names; it keys the profile's cache (a
new lever costs one more profiling run, once) and is applied on the torch side by
``step.applied_levers`` the way the real libraries apply it.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass

from .checkpoint_policy import (
    CheckpointPolicyName,
    CheckpointPolicyValue,
    policy_label,
    resolve_checkpoint_policy,
)

__all__ = [
    "LEVER_KEYWORDS",
    "NO_LEVERS",
    "Levers",
    "parse_lora_dtype",
    "repeated_blocks",
    "resolve_levers",
    "resolve_lora",
]


@dataclass(frozen=True)
class Levers:
    """Levers of one training step, resolved to names.

    Attributes
    ----------
    checkpoint : tuple of str
        Qualified names of the modules whose forward is recomputed in the backward
        (``torch.utils.checkpoint``, ``use_reentrant=False``), outermost only.
    checkpoint_policy : CheckpointPolicyName, int or callable
        How each block of ``checkpoint`` is checkpointed (``checkpoint_policy.py``):
        ``"full"`` (the whole forward recomputed), ``"op"`` (torchtitan's op-level
        selective checkpointing), k (every k-th of them, fully) or a callable policy given
        to ``torch.utils.checkpoint.create_selective_checkpoint_contexts``.
    checkpoint_hf : bool
        True where ``checkpoint="auto"`` on a Hugging Face model: applied by its own
        ``activation_checkpointing_enable`` (which wraps ``checkpoint``), so that what it
        also changes (``use_cache`` off in training, inputs that require grad) is applied too.
    trainable : tuple of str or None
        Names of the parameters that train (all others frozen); None: as the model has them.
    grad_accumulation : int
        Micro-batches whose gradients accumulate before one ``optimizer.step()``.
    lora_rank : int or None
        LoRA adapters of this rank, applied by PEFT's ``get_peft_model`` (None: no LoRA).
    lora_targets : tuple of str or None
        PEFT's ``target_modules`` (None: PEFT's defaults for the architecture).
    param_dtype : str or None
        The dtype the step's parameters are in where a wrapper casts them ("bfloat16":
        FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` under amp-bf16); None:
        the precision's. Set by ``estimate`` for a strategy, not a user lever.
    set_to_none : bool
        ``optimizer.zero_grad(set_to_none=...)``: False keeps the gradients allocated (zeroed
        in place) between steps, so the step starts with them resident and the backward adds
        into them. Set by ``estimate`` from its Recipe's optimizer.
    in_backward : str or None
        The optimizer (a suffixed name, ``"adam-foreach"``) that steps each parameter in its
        post-accumulate-grad hook during the backward (torchtune's ``optimizer_in_bwd``);
        None: one ``optimizer.step()`` after the backward. Set by ``estimate`` from its
        Recipe's optimizer.
    outputs_freed : bool
        The model's outputs dropped once the loss is computed, before the backward (the
        Recipe's ``step.outputs="freed"``), instead of kept to the end of the step.
    loss_scaled : bool
        The backward runs on ``loss / grad_accumulation`` (a new scalar), the loss kept (the
        Recipe's ``step.loss_scaled``).
    decay_groups : bool
        The optimizer over Hugging Face ``Trainer``'s two parameter groups (the Recipe's
        ``optimizer.param_groups="decay-split"``) instead of one.
    carried_scalars : bool
        The loop's last loss and gradient norm carried from step to step (the Recipe's
        ``step.carried_scalars``).
    clip_grad_norm : bool
        ``torch.nn.utils.clip_grad_norm_`` over the gradients between the backward and the
        optimizer step, its total norm kept to the end of the step (the Recipe's
        ``optimizer.clip_grad_norm``; the norm's value changes no memory).
    loss_chunks : int or None
        The output projection and the cross-entropy run on this many chunks of the
        sequence, torchtune's ``CEWithChunkedOutputLoss`` (the Recipe's
        ``levers.loss_chunks``, ``chunked_loss.py``); None: the model's own output and loss.
    offload_activations : str or None
        The forward's saved tensors offloaded to host memory (``offloading.py``):
        ``"torchtune"`` (torchtune's ``OffloadActivations``) or ``"save_on_cpu"`` (torch's
        ``save_on_cpu``); None: kept on the device.
    compile : str or None
        The step as ``torch.compile`` runs it (``compiled.py``): ``"model"`` (the whole
        model) or ``"blocks"`` (each repeated block); None: eager.
    activation_memory_budget : float or None
        With ``compile``: the partitioner's ``activation_memory_budget`` (None: its
        default, 1.0).
    compile_batch : int or None
        With ``compile``: the batch size the compiled step is profiled at (the partition
        may change with the batch: ``compiled.decided_at``). Set by ``estimate`` (the asked
        batch size), not a user lever.
    """

    checkpoint: tuple[str, ...] = ()
    checkpoint_policy: CheckpointPolicyValue = CheckpointPolicyName.FULL
    checkpoint_hf: bool = False
    trainable: tuple[str, ...] | None = None
    grad_accumulation: int = 1
    lora_rank: int | None = None
    lora_targets: tuple[str, ...] | None = None
    param_dtype: str | None = None
    set_to_none: bool = True
    in_backward: str | None = None
    outputs_freed: bool = False
    loss_scaled: bool = False
    carried_scalars: bool = False
    clip_grad_norm: bool = False
    decay_groups: bool = False
    loss_chunks: int | None = None
    offload_activations: str | None = None
    compile: str | None = None
    activation_memory_budget: float | None = None
    compile_batch: int | None = None

    @property
    def active(self) -> bool:
        return (
            bool(self.checkpoint)
            or self.trainable is not None
            or self.grad_accumulation > 1
            or self.lora_rank is not None
            or not self.set_to_none
            or self.in_backward is not None
            or self.outputs_freed
            or self.loss_scaled
            or self.carried_scalars
            or self.clip_grad_norm
            or self.decay_groups
            or self.loss_chunks is not None
            or self.offload_activations is not None
            or self.compile is not None
        )

    @property
    def profiled_micro_batches(self) -> int:
        """Micro-batches a profiling run takes: 2 for any accumulation (the second and later
        ones run with the gradients resident, and are the same step), else 1."""
        return min(self.grad_accumulation, 2)

    def for_profiling(self) -> Levers:
        """The levers of the run that profiles these: accumulation of k > 2 is the run of 2
        (the same memory; its FLOPs are scaled by k / 2)."""
        if self.grad_accumulation <= 2:
            return self
        return dataclasses.replace(self, grad_accumulation=2)

    def describe(self) -> str:
        """A short text: ``checkpoint 12 modules (GPT2Block), trainable 2 tensors, x4``."""
        parts = []
        if self.checkpoint:
            parts.append(f"checkpointing {len(self.checkpoint)} module(s)")
            if self.checkpoint_policy is not CheckpointPolicyName.FULL:
                parts[-1] += f" ({policy_label(self.checkpoint_policy)})"
        if self.trainable is not None:
            parts.append(f"{len(self.trainable)} trainable tensor(s)")
        if self.lora_rank is not None:
            targets = ", ".join(self.lora_targets) if self.lora_targets else "PEFT's defaults"
            parts.append(f"LoRA rank {self.lora_rank} on {targets}")
        if self.grad_accumulation > 1:
            parts.append(f"{self.grad_accumulation} micro-batches accumulated")
        if not self.set_to_none:
            parts.append("gradients zeroed in place")
        if self.in_backward is not None:
            parts.append(f"{self.in_backward} stepped in the backward")
        if self.outputs_freed:
            parts.append("outputs freed before the backward")
        if self.loss_scaled:
            parts.append("backward on the scaled loss")
        if self.carried_scalars:
            parts.append("loss and norm carried between steps")
        if self.clip_grad_norm:
            parts.append("gradients clipped by norm")
        if self.decay_groups:
            parts.append("decay / no-decay parameter groups")
        if self.loss_chunks is not None:
            parts.append(f"output and loss in {self.loss_chunks} chunks")
        if self.offload_activations is not None:
            how = {"torchtune": "torchtune's OffloadActivations"}
            label = how.get(self.offload_activations, self.offload_activations)
            parts.append(f"saved activations offloaded to the host ({label})")
        if self.compile is not None:
            parts.append(f"torch.compile ({self.compile})")
            if self.activation_memory_budget is not None:
                parts[-1] += f", activation_memory_budget {self.activation_memory_budget:g}"
        return ", ".join(parts) or "no levers"


NO_LEVERS = Levers()

# The keywords of ``estimate`` (and of everything that forwards to it) that are levers.
LEVER_KEYWORDS = ("checkpoint", "trainable", "grad_accumulation", "lora_rank", "lora_targets")


def _outermost(names: Sequence[str]) -> tuple[str, ...]:
    """Names none of whose ancestors is in ``names`` (a checkpointed block's children are
    recomputed with it), in the given order."""
    chosen = set(names)

    def has_ancestor(name: str) -> bool:
        parts = name.split(".")
        return ("" in chosen and name != "") or any(
            ".".join(parts[:k]) in chosen for k in range(1, len(parts))
        )

    return tuple(n for n in names if not has_ancestor(n))


def _examples(names: Sequence[str], limit: int = 6) -> str:
    shown = [repr(n) for n in names[:limit]]
    return ", ".join(shown) + (", ..." if len(names) > limit else "")


# torch's containers: repeated in most models, never what a person means by "a block"
_CONTAINERS = frozenset({"Sequential", "ModuleList", "ModuleDict"})


def _resolve_checkpoint(
    value: object,
    module_names: Sequence[str],
    module_types: Sequence[str],
    auto_blocks: Sequence[str],
    hf_auto: bool,
    model_name: str,
) -> tuple[tuple[str, ...], bool]:
    if value is None or value is False:
        return (), False
    # the model's own classes with repeated instances, and its top-level children: what
    # the suggestions name (never a class or module the model does not have)
    classes = sorted({t for t in module_types if module_types.count(t) > 1})
    if value == "auto":
        if not auto_blocks:
            parents = {n.rpartition(".")[0] for n in module_names if n}
            top = [n for n in module_names if n and "." not in n]
            children = ([n for n in top if n in parents] or top)[:2]
            # a block: a repeated class whose instances hold modules, not a plain container
            holders = {t for n, t in zip(module_names, module_types, strict=True) if n in parents}
            blocks = [c for c in classes if c not in _CONTAINERS and c in holders]
            by_class = f"checkpoint={(blocks or classes)[0]!r}" if classes else "none repeats"
            by_name = f"checkpoint={children!r}" if children else "checkpoint=['name']"
            raise ValueError(
                f"checkpoint='auto': {model_name or 'the model'} has no ModuleList of repeated "
                "blocks to checkpoint; name the modules instead: a class name "
                f"({by_class}; its classes with repeated instances: "
                f"{', '.join(classes) or 'none'}) or a list of qualified-name patterns "
                f"({by_name})"
            )
        return tuple(auto_blocks), hf_auto
    if isinstance(value, str):
        matched = [n for n, t in zip(module_names, module_types, strict=True) if t == value and n]
        if not matched:
            raise ValueError(
                f"checkpoint={value!r}: no module of that class in {model_name or 'the model'}; "
                f"valid forms: 'auto', a class name (classes with repeated instances: "
                f"{', '.join(classes) or 'none'}), or a list of qualified-name patterns"
            )
        return _outermost(matched), False
    if isinstance(value, Sequence) and not isinstance(value, bytes):
        patterns = list(value)
        if not patterns or not all(isinstance(p, str) for p in patterns):
            raise TypeError(
                f"checkpoint={value!r}: give 'auto', a class name, or a non-empty list of "
                "qualified-name patterns (strings, fnmatch syntax)"
            )
        matched_names: list[str] = []
        for pattern in patterns:
            hits = [n for n in module_names if n and fnmatch.fnmatchcase(n, pattern)]
            if not hits:
                raise ValueError(
                    f"checkpoint pattern {pattern!r} matches no module; module names look "
                    f"like {_examples([n for n in module_names if n])}"
                )
            matched_names += [h for h in hits if h not in matched_names]
        order = {n: i for i, n in enumerate(module_names)}
        return _outermost(sorted(matched_names, key=order.__getitem__)), False
    raise TypeError(
        f"checkpoint={value!r}: give None, 'auto', a class name, or a list of qualified-name "
        "patterns"
    )


def _resolve_trainable(value: object, param_names: Sequence[str]) -> tuple[str, ...] | None:
    if value is None:
        return None
    patterns = [value] if isinstance(value, str) else value
    if (
        not isinstance(patterns, Sequence)
        or not patterns
        or not all(isinstance(p, str) for p in patterns)
    ):
        raise TypeError(
            f"trainable={value!r}: give None (as the model is) or glob patterns of parameter "
            "names (a string or a non-empty list of strings, fnmatch syntax)"
        )
    chosen: set[str] = set()
    for pattern in patterns:
        hits = {n for n in param_names if fnmatch.fnmatchcase(n, pattern)}
        if not hits:
            raise ValueError(
                f"trainable pattern {pattern!r} matches no parameter; parameter names look "
                f"like {_examples(list(param_names))}"
            )
        chosen |= hits
    return tuple(n for n in param_names if n in chosen)


def resolve_levers(
    *,
    module_names: Sequence[str],
    module_types: Sequence[str],
    param_names: Sequence[str],
    auto_blocks: Sequence[str] = (),
    hf_auto: bool = False,
    model_name: str = "",
    checkpoint: object = None,
    trainable: object = None,
    grad_accumulation: object = 1,
    lora_rank: object = None,
    lora_targets: object = "auto",
    checkpoint_policy: object = None,
) -> Levers:
    """The :class:`Levers` a user's keywords mean for this model, or a ValueError /
    TypeError that names the problem and the valid forms.

    Parameters
    ----------
    module_names, module_types
        Qualified names and class names of the model's modules (``named_modules`` order).
    param_names
        Qualified names of its parameters (tied ones once).
    auto_blocks, hf_auto
        What ``checkpoint="auto"`` means: the children of the largest ``ModuleList`` of
        repeated blocks (the layers Hugging Face's ``activation_checkpointing_enable``
        wraps, for its models), and whether Hugging Face's own call applies it.
    checkpoint : None, "auto", str or list of str
        None: no checkpointing. ``"auto"``: ``auto_blocks``. A class name: every module of
        that class (outermost ones). A list: fnmatch patterns of qualified module names.
    trainable : None, str or list of str
        fnmatch patterns of the parameter names that train; every other is frozen.
    grad_accumulation : int
        Micro-batches per optimizer step (>= 1).
    lora_rank, lora_targets
        LoRA by PEFT (:func:`resolve_lora`); not with ``trainable`` (PEFT decides what
        trains).
    checkpoint_policy : None, "full", "op", int or callable
        How each checkpointed block is checkpointed
        (:func:`~vram_widget._estimating.checkpoint_policy.resolve_checkpoint_policy`);
        None: ``"full"``. Given without ``checkpoint``, it applies to ``checkpoint="auto"``'s
        blocks (the repeated layers, as torchtitan applies it to ``model.layers``).

    Examples
    --------
    >>> names = ("", "h", "h.0", "h.0.fc", "h.1", "h.1.fc", "head")
    >>> types = ("Net", "ModuleList", "Block", "Linear", "Block", "Linear", "Linear")
    >>> params = ("h.0.fc.weight", "h.1.fc.weight", "head.weight", "head.bias")
    >>> lv = resolve_levers(module_names=names, module_types=types, param_names=params,
    ...                     checkpoint="Block", trainable="head.*", grad_accumulation=4)
    >>> lv.checkpoint, lv.trainable, lv.grad_accumulation
    (('h.0', 'h.1'), ('head.weight', 'head.bias'), 4)
    >>> resolve_levers(module_names=names, module_types=types, param_names=params,
    ...                auto_blocks=("h.0", "h.1"), checkpoint_policy=2).describe()
    'checkpointing 2 module(s) (every 2nd block)'
    """
    if isinstance(grad_accumulation, bool) or not isinstance(grad_accumulation, int):
        raise TypeError(f"grad_accumulation must be an integer >= 1, got {grad_accumulation!r}")
    if grad_accumulation < 1:
        raise ValueError(
            f"grad_accumulation must be >= 1 (micro-batches per optimizer step), got "
            f"{grad_accumulation}"
        )
    rank, targets = resolve_lora(lora_rank, lora_targets)
    if rank is not None and trainable is not None:
        raise ValueError(
            "give trainable or lora_rank, not both: with LoRA, PEFT decides what trains "
            "(the adapters; every base weight is frozen)"
        )
    implied = checkpoint_policy is not None and checkpoint is None
    try:
        names, hf = _resolve_checkpoint(
            "auto" if implied else checkpoint,
            module_names,
            module_types,
            auto_blocks,
            hf_auto,
            model_name,
        )
    except ValueError as exc:
        if not implied:
            raise
        raise ValueError(
            f"checkpoint_policy={checkpoint_policy!r} applies to the blocks checkpoint= "
            f"names (checkpoint='auto' when not given), and {exc}"
        ) from None
    policy: CheckpointPolicyValue = CheckpointPolicyName.FULL
    if names:
        policy = resolve_checkpoint_policy(checkpoint_policy, names)
    return Levers(
        checkpoint=names,
        checkpoint_policy=policy,
        checkpoint_hf=hf,
        trainable=_resolve_trainable(trainable, param_names),
        grad_accumulation=int(grad_accumulation),
        lora_rank=rank,
        lora_targets=targets,
    )


def repeated_blocks(module_names: Sequence[str], module_types: Sequence[str]) -> tuple[str, ...]:
    """The children of the largest ``ModuleList`` or ``ModuleDict`` whose children are all
    of one class (at least two of them): the per-layer blocks that Hugging Face's
    checkpointing and torchtune's per-layer checkpointing wrap, and torchtitan's
    ``model.layers`` (a ``ModuleDict`` keyed by layer index, torchtitan 0.3.0
    ``models/common/decoder.py``, whose children ``ActivationCheckpointing.apply`` wraps
    one by one, ``distributed/activation_checkpoint.py``). Ties go to the first in module
    order.

    Examples
    --------
    >>> repeated_blocks(("", "h", "h.0", "h.1", "h.0.fc"), ("M", "ModuleList", "B", "B", "L"))
    ('h.0', 'h.1')
    >>> repeated_blocks(("", "layers", "layers.0", "layers.1"), ("M", "ModuleDict", "B", "B"))
    ('layers.0', 'layers.1')
    """
    best: tuple[str, ...] = ()
    types = dict(zip(module_names, module_types, strict=True))
    for name, kind in types.items():
        if kind not in ("ModuleList", "ModuleDict"):
            continue
        prefix = name + "." if name else ""
        children = [
            n for n in module_names if n.startswith(prefix) and "." not in n[len(prefix) :] and n
        ]
        children = [n for n in children if n != name]
        same_class = len(children) >= 2 and len({types[c] for c in children}) == 1
        if same_class and len(children) > len(best):
            best = tuple(children)
    return best


def resolve_lora(rank: object, targets: object) -> tuple[int | None, tuple[str, ...] | None]:
    """``lora_rank`` and ``lora_targets`` checked: (None, None) without LoRA; targets None
    for ``"auto"`` (PEFT's defaults for the architecture), else PEFT's ``target_modules``
    (module-name suffixes, or ``"all-linear"``).

    Examples
    --------
    >>> resolve_lora(8, "auto"), resolve_lora(4, ["q_proj", "v_proj"]), resolve_lora(None, "auto")
    ((8, None), (4, ('q_proj', 'v_proj')), (None, None))
    """
    if rank is None:
        if targets not in ("auto", None):
            raise ValueError("lora_targets needs lora_rank: give lora_rank=<int >= 1> too")
        return None, None
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"lora_rank must be an integer >= 1 (the adapters' rank), got {rank!r}")
    if rank < 1:
        raise ValueError(f"lora_rank must be >= 1 (the adapters' rank), got {rank}")
    if targets in ("auto", None):
        return rank, None
    names = [targets] if isinstance(targets, str) else targets
    if (
        not isinstance(names, Sequence)
        or not names
        or not all(isinstance(n, str) and n for n in names)
    ):
        raise TypeError(
            f"lora_targets={targets!r}: give 'auto' (PEFT's defaults for the architecture), "
            "'all-linear', or a non-empty list of module names or name suffixes "
            "(PEFT's target_modules)"
        )
    return rank, tuple(names)


_LORA_DTYPES = {
    "fp32": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "base": "base",
}


def parse_lora_dtype(value: object) -> str | None:
    """The LoRA adapters' dtype as asked: None (PEFT's default), ``"base"`` or a torch
    dtype name (``"float32"``, ``"bfloat16"``, ``"float16"``).

    None follows PEFT: ``get_peft_model(..., autocast_adapter_dtype=True)`` (its default)
    upcasts float16 / bfloat16 adapters to float32 (peft 0.21 tuners_utils.py,
    ``cast_adapter_dtype``), so the adapters are fp32 on any base. ``"base"`` keeps them in
    the base weights' dtype, as PEFT does with ``autocast_adapter_dtype=False`` (it moves
    each adapter to its base layer's device and float dtype,
    ``_move_adapter_to_device_of_base_layer``) and torchtune's LoRA recipes do.

    Examples
    --------
    >>> parse_lora_dtype(None), parse_lora_dtype("bf16"), parse_lora_dtype("base")
    (None, 'bfloat16', 'base')
    >>> parse_lora_dtype("int8")
    Traceback (most recent call last):
    ...
    ValueError: lora_dtype must be None (PEFT's default: fp32 adapters), "base" (the base ...
    """
    if value is None:
        return None
    key = value.lower() if isinstance(value, str) else value
    if key not in _LORA_DTYPES:
        raise ValueError(
            'lora_dtype must be None (PEFT\'s default: fp32 adapters), "base" (the base '
            'weights\' dtype, as torchtune keeps them), "fp32", "bf16" or "fp16"; got '
            f"{value!r}"
        )
    return _LORA_DTYPES[key]
