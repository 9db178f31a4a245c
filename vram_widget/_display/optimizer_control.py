"""The widget's optimizer controls: which optimizer, how torch.optim runs it, and how it steps.

``ipywidgets.Dropdown`` has no option groups, so an optimizer name such as ``"adamw-fused"``
is shown as two dropdowns: the optimizer (``adamw``) and its implementation (``fused``; the
second is disabled for an optimizer torch.optim implements one way only). Beside them, two
checkboxes: the optimizer stepped in the backward, and the gradients kept between steps
(``zero_grad(set_to_none=False)``). The widget's traits stay the truth: ``optimizer`` holds
the whole name ``estimate`` takes, and the controls are views of it that write it back.

The names come from :func:`~vram_widget._estimating.options.optimizer_names` when the
controls are built, so every optimizer the estimate accepts is offered.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ipywidgets as widgets
import traitlets

from .._estimating.options import (
    Device,
    OptimizerImplementation,
    default_implementation,
    optimizer_names,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "DEFAULT_IMPLEMENTATION",
    "NO_OPTIMIZER",
    "OptimizerControls",
    "join_choice",
    "optimizer_groups",
    "split_choice",
]

NO_OPTIMIZER = "none"
# the implementation control's value for "torch's own default on the device"
DEFAULT_IMPLEMENTATION = "default"
_IMPLEMENTATION_LABELS = {
    OptimizerImplementation.FUSED.value: "fused",
    OptimizerImplementation.FOREACH.value: "foreach",
    OptimizerImplementation.FORLOOP.value: "for-loop",
}
IN_BACKWARD_TOOLTIP = (
    "optimizer in backward (torchtune's optimizer_in_bwd): each parameter is stepped, and "
    "its gradient freed, in its post-accumulate-grad hook during the backward, so the "
    "gradients of the whole model are never all alive at once; one GPU and one "
    "micro-batch only"
)
KEEP_GRADS_TOOLTIP = (
    "optimizer.zero_grad(set_to_none=False): the gradients are zeroed in place and stay "
    "allocated between steps, instead of being freed (torch's default since 2.0 is "
    "set_to_none=True)"
)


def split_choice(name: str, names: Sequence[str] | None = None) -> tuple[str, str | None]:
    """An optimizer name as ``(optimizer, implementation)``: ``"adamw-fused"`` is
    ``("adamw", "fused")``; a name without an implementation suffix (or one whose stem is
    no optimizer of ``names``) is itself, with None.

    Examples
    --------
    >>> split_choice("sgd-momentum-foreach")
    ('sgd-momentum', 'foreach')
    >>> split_choice("adagrad"), split_choice("none")
    (('adagrad', None), ('none', None))
    """
    known = optimizer_names() if names is None else names
    for impl in OptimizerImplementation:
        suffix = f"-{impl.value}"
        if name.endswith(suffix) and name[: -len(suffix)] in known:
            return name[: -len(suffix)], impl.value
    return name, None


def join_choice(optimizer: str, implementation: str | None) -> str:
    """The optimizer name ``estimate`` takes for an optimizer and an implementation
    (None or ``"default"``: torch's default, no suffix).

    Examples
    --------
    >>> join_choice("adamw", "fused"), join_choice("adamw", "default")
    ('adamw-fused', 'adamw')
    """
    if implementation in (None, DEFAULT_IMPLEMENTATION) or optimizer == NO_OPTIMIZER:
        return optimizer
    return f"{optimizer}-{implementation}"


def optimizer_groups() -> dict[str, tuple[str, ...]]:
    """Each optimizer of :func:`optimizer_names` (its name without an implementation
    suffix), in that order, with the implementations it takes (empty: torch.optim runs it
    one way only, or it is another library's).

    Examples
    --------
    >>> optimizer_groups()["adamw"]
    ('fused', 'foreach', 'forloop')
    >>> optimizer_groups()["adagrad"]
    ()
    """
    names = optimizer_names()
    groups: dict[str, list[str]] = {}
    for name in names:
        base, impl = split_choice(name, names)
        groups.setdefault(base, [])
        if impl is not None:
            groups[base].append(impl)
    return {base: tuple(impls) for base, impls in groups.items()}


class OptimizerControls:
    """The optimizer and implementation dropdowns and the two stepping checkboxes of one
    widget, kept in step with its ``optimizer``, ``optimizer_in_backward`` and
    ``set_to_none`` traits (a control writes its trait; a trait change, a refused one put
    back included, rewrites the controls)."""

    def __init__(self, owner: traitlets.HasTraits, device: Device) -> None:
        self._owner = owner
        self._syncing = False
        self.groups = optimizer_groups()
        default = default_implementation(device).value
        self.optimizer = widgets.Dropdown(
            options=[*self.groups, NO_OPTIMIZER],
            description="optimizer",
            layout={"width": "230px"},
            tooltip="the optimizer whose state and step are estimated",
        )
        default_label = f"default ({_IMPLEMENTATION_LABELS[default]} on {device.value})"
        self.implementation = widgets.Dropdown(
            options=[
                (default_label, DEFAULT_IMPLEMENTATION),
                *((label, value) for value, label in _IMPLEMENTATION_LABELS.items()),
            ],
            description="implementation",
            layout={"width": "300px"},
            tooltip="how torch.optim runs the step: fused=True, foreach=True or "
            "foreach=False (a for-loop over the parameters); default: torch's choice for "
            "the device",
        )
        self.in_backward = widgets.Checkbox(
            description="in backward",
            indent=False,
            layout={"width": "120px"},
            tooltip=IN_BACKWARD_TOOLTIP,
        )
        self.keep_grads = widgets.Checkbox(
            description="keep grads",
            indent=False,
            layout={"width": "120px"},
            tooltip=KEEP_GRADS_TOOLTIP,
        )
        for control in self.widgets:
            control.style.description_width = "initial"
            control.observe(self._control_moved, "value")
        # not traitlets.link: a refused setting is put back while the control's own change
        # is being handled, which a link does not show on the control
        owner.observe(self._trait_changed, ["optimizer", "optimizer_in_backward", "set_to_none"])
        self.sync()

    @property
    def widgets(self) -> tuple[widgets.DOMWidget, ...]:
        """Every control, in the order they are shown."""
        return (self.optimizer, self.implementation, self.in_backward, self.keep_grads)

    def sync(self) -> None:
        """Show the owner's traits on the controls without writing them back."""
        owner: Any = self._owner
        base, impl = split_choice(owner.optimizer)
        self._syncing = True
        try:
            self.optimizer.value = base
            self.implementation.value = impl or DEFAULT_IMPLEMENTATION
            self.in_backward.value = owner.optimizer_in_backward
            self.keep_grads.value = not owner.set_to_none
        finally:
            self._syncing = False
        self.enable()

    def enable(self) -> None:
        """The implementation control, usable only for an optimizer that has several."""
        self.implementation.disabled = not self.groups.get(self.optimizer.value)

    def _control_moved(self, change: dict[str, Any]) -> None:
        if self._syncing:
            return
        owner: Any = self._owner
        if change["owner"] is self.in_backward:
            owner.optimizer_in_backward = self.in_backward.value
        elif change["owner"] is self.keep_grads:
            owner.set_to_none = not self.keep_grads.value
        else:
            base = self.optimizer.value
            impl = self.implementation.value
            if impl not in self.groups.get(base, ()):
                impl = DEFAULT_IMPLEMENTATION  # an optimizer with no such implementation
            owner.optimizer = join_choice(base, impl)
        self.sync()  # the trait may have been put back (a refused setting)

    def _trait_changed(self, _change: dict[str, Any]) -> None:
        self.sync()
