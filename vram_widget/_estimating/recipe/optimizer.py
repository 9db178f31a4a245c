"""Which optimizer steps the parameters, and how torch.optim runs it."""

from __future__ import annotations

import dataclasses

from ..options import (
    OPTIMIZER_PACKAGES,
    CustomOptimizer,
    Device,
    OptimizerChoice,
    OptimizerImplementation,
    OptimizerName,
    ParamGroups,
    default_implementation,
    parse_optimizer_choice,
    parse_option,
)


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """The optimizer of a training step.

    Attributes
    ----------
    name : OptimizerName or CustomOptimizer, optional
        ``"sgd"``, ``"sgd-momentum"``, ``"adam"``, ``"adamw"``, ``"adagrad"``, ``"rmsprop"``;
        the other libraries' ``"adamw8bit"``, ``"paged-adamw8bit"`` (bitsandbytes),
        ``"adamw8bit-torchao"``, ``"adamw4bit-torchao"`` (torchao), ``"adafactor"``
        (transformers); or a callable ``params -> torch.optim.Optimizer`` (held as a
        :class:`~vram_widget._estimating.options.CustomOptimizer`, equal by identity).
        None: no optimizer step.
    implementation : OptimizerImplementation, optional
        ``"fused"``, ``"foreach"`` or ``"forloop"`` (SGD and Adam / AdamW only); None:
        torch's own default on the target device (:meth:`resolved_implementation`).
    in_backward : bool
        Each parameter stepped, and its gradient freed, in its post-accumulate-grad hook
        during the backward (torchtune's ``optimizer_in_bwd``), instead of one
        ``optimizer.step()`` after it.
    set_to_none : bool
        ``optimizer.zero_grad(set_to_none=...)``: True (torch's default since 2.0) frees the
        gradients after the step; False zeroes them in place, so they stay allocated
        between steps.
    clip_grad_norm : float, optional
        ``torch.nn.utils.clip_grad_norm_(parameters, clip_grad_norm)`` between the backward
        and the optimizer step (the Trainer's ``max_grad_norm``, torchtune's
        ``clip_grad_norm``), its total norm held to the end of the step; ``inf`` computes
        the norm and scales by 1 (the Trainer with ``max_grad_norm=0``); None: no clipping.
    param_groups : ParamGroups
        ``"one"``: every trainable parameter in one group, in the model's order;
        ``"decay-split"``: Hugging Face ``Trainer.create_optimizer``'s two groups, the
        parameters weight decay applies to, then the others (norms, biases). The groups
        change the step's temporaries (a for-loop step holds one parameter's while making
        the next one's; foreach and fused make theirs per group).
        Its per-tensor norms (one scalar each, stacked) and the clipping coefficient are the
        memory it adds; the value itself changes none.

    Examples
    --------
    >>> Optimizer.parse("adamw-fused").implementation
    <OptimizerImplementation.FUSED: 'fused'>
    >>> Optimizer.parse("adamw").resolved_implementation("cuda")
    <OptimizerImplementation.FOREACH: 'foreach'>
    """

    name: OptimizerChoice | None = OptimizerName.ADAM
    implementation: OptimizerImplementation | None = None
    in_backward: bool = False
    set_to_none: bool = True
    clip_grad_norm: float | None = None
    param_groups: ParamGroups = ParamGroups.ONE

    def __post_init__(self) -> None:
        self._check_clip()
        groups = parse_option(ParamGroups, self.param_groups, "param_groups")
        object.__setattr__(self, "param_groups", groups)
        for flag in ("in_backward", "set_to_none"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        if self.in_backward and not self.set_to_none:
            raise ValueError(
                "set_to_none=False cannot go with in_backward=True: stepping in the backward "
                "frees each gradient right after its parameter's step, so no gradient is kept "
                "between steps to be zeroed in place"
            )
        if self.name is not None and not isinstance(self.name, (OptimizerName, CustomOptimizer)):
            name, impl = parse_optimizer_choice(self.name)
            if impl is not None and self.implementation not in (None, impl):
                raise ValueError(
                    f"optimizer name {self.name!r} names the implementation {impl.value!r}, "
                    f"but implementation={self.implementation!r}: give one of them"
                )
            object.__setattr__(self, "name", name)
            object.__setattr__(self, "implementation", impl or self.implementation)
        if self.implementation is not None:
            impl = parse_option(OptimizerImplementation, self.implementation, "implementation")
            object.__setattr__(self, "implementation", impl)
            if self.name is not None and f"{self.name.value}-{impl.value}" not in _suffixed():
                raise ValueError(
                    f"torch.optim has no {impl.value} implementation of {self.name.value!r}; "
                    "fused, foreach and forloop are for 'sgd', 'sgd-momentum', 'adam' and "
                    "'adamw' (leave implementation=None for torch's default)"
                )

    def _check_clip(self) -> None:
        clip = self.clip_grad_norm
        if clip is None:
            return
        # inf is valid: the norm is computed and nothing is scaled down (the Trainer reads
        # its gradients' norm so), with the same memory
        if isinstance(clip, bool) or not isinstance(clip, int | float) or not clip > 0:
            raise ValueError(
                f"clip_grad_norm must be a positive number (the max norm given to "
                f"torch.nn.utils.clip_grad_norm_; float('inf') to read the norm without "
                f"clipping) or None for no clipping; got {clip!r}"
            )
        if self.in_backward:
            # torchtune refuses the pair too (recipes/full_finetune_single_device.py,
            # _setup: "Gradient clipping is not supported with optimizer in bwd")
            raise ValueError(
                "clip_grad_norm cannot go with in_backward=True: each parameter is stepped "
                "in the backward before the total norm of all gradients exists; use "
                "clip_grad_norm=None"
            )
        object.__setattr__(self, "clip_grad_norm", float(clip))

    @classmethod
    def parse(cls, value: object) -> Optimizer:
        """An ``optimizer=`` keyword's value (a name, a suffixed name or None) as a record."""
        if isinstance(value, Optimizer):
            return value
        name, impl = parse_optimizer_choice(value)
        return cls(name, impl)

    def named(self, value: object) -> Optimizer:
        """This record with the name (and implementation) that ``value`` gives, keeping how
        it is stepped (``in_backward``, ``set_to_none``, ``clip_grad_norm``,
        ``param_groups``)."""
        parsed = Optimizer.parse(value)
        return dataclasses.replace(
            parsed,
            in_backward=self.in_backward,
            set_to_none=self.set_to_none,
            clip_grad_norm=self.clip_grad_norm,
            param_groups=self.param_groups,
        )

    @property
    def runs_on_torch_optim(self) -> bool:
        """Whether the optimizer is a ``torch.optim`` class (fused, foreach or for-loop).

        Examples
        --------
        >>> Optimizer.parse("adam").runs_on_torch_optim
        True
        >>> Optimizer.parse("adafactor").runs_on_torch_optim
        False
        """
        return isinstance(self.name, OptimizerName) and self.name not in OPTIMIZER_PACKAGES

    def resolved_implementation(self, device: str | Device) -> OptimizerImplementation | None:
        """The implementation that runs on ``device``: the one asked, else torch's default
        there (:func:`~vram_widget._estimating.options.default_implementation`); None
        without an optimizer, and for one that is not a ``torch.optim`` class (another
        library's, or a callable's: they run their own ``step()``)."""
        if self.name is None or not self.runs_on_torch_optim:
            return None
        if self.implementation is not None:
            return self.implementation
        return default_implementation(parse_option(Device, device, "device"))


def _suffixed() -> frozenset[str]:
    from ..options import optimizer_names

    return frozenset(optimizer_names())
