"""How the optimizer is stepped: in the backward, one optimizer per parameter, and the
gradients kept between steps (``zero_grad(set_to_none=False)``).

Used by both the profiler (on fake tensors, its hooks recorded with the backward) and
``measure`` (on real ones), so that the estimate and the measurement run the same mechanism.

Optimizer in backward follows torchtune (``torchtune/training/memory.py``, 0.6.1):
``create_optim_in_bwd_wrapper`` builds ``{p: optimizer([p]) for p in model.parameters()}``
and ``register_optim_in_bwd_hooks`` registers on every parameter that requires grad::

    def optim_step(param) -> None:
        optim_dict[param].step()
        optim_dict[param].zero_grad()

    p.register_post_accumulate_grad_hook(optim_step)

(torch's ``torch/distributed/optim/apply_optimizer_in_backward.py`` is the same idea.) The
hook runs once the autograd engine has accumulated the parameter's gradient into ``.grad``
(``AccumulateGrad``, ``torch/csrc/autograd/functions/accumulate_grad.h``), and ``zero_grad``
(``set_to_none=True``, torch's default since 2.0) frees it: at most the gradients of the
parameters whose hook has not run yet are alive.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .._estimating.options import (
    OptimizerChoice,
    OptimizerImplementation,
    OptimizerName,
    parse_option,
)
from .step import make_optimizer

__all__ = ["OptimizerInBackward", "zero_grads_in_place"]


class OptimizerInBackward:
    """One optimizer per trainable parameter, stepped in that parameter's
    post-accumulate-grad hook (torchtune's ``optimizer_in_bwd``).

    Parameters
    ----------
    params : sequence of Tensor
        The parameters; those that do not require grad get no optimizer and no hook.
    name : OptimizerName or CustomOptimizer
        The optimizer each parameter gets.
    implementation : OptimizerImplementation or None
        How torch.optim runs each one's step (None: torch's default on the device).

    Examples
    --------
    >>> import torch
    >>> from vram_widget._estimating.options import OptimizerName
    >>> layer = torch.nn.Linear(3, 2)
    >>> stepper = OptimizerInBackward(list(layer.parameters()), OptimizerName.ADAM, None)
    >>> with stepper.hooked():
    ...     layer(torch.ones(1, 3)).sum().backward()
    >>> layer.weight.grad is None  # stepped and freed in the backward
    True
    >>> sorted(stepper.optimizers[0].state[layer.weight])
    ['exp_avg', 'exp_avg_sq', 'step']
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        name: OptimizerChoice,
        implementation: OptimizerImplementation | None,
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.optimizers = [make_optimizer(name, [p], implementation) for p in self.params]
        self._by_param = {id(p): opt for p, opt in zip(self.params, self.optimizers, strict=True)}
        self.stepped: list[torch.Tensor] = []  # the parameters stepped, in the hooks' order
        self.before_step: Callable[[torch.Tensor], None] | None = None
        self.after_step: Callable[[torch.Tensor], None] | None = None

    @classmethod
    def from_choice(cls, params: Sequence[torch.Tensor], choice: str) -> OptimizerInBackward:
        """From an optimizer name, suffixed with the implementation that runs it where one
        is given (``"adam-foreach"``, ``"rmsprop-foreach"``, ``"sgd"``): the form of
        ``Levers.in_backward``."""
        head, _, tail = choice.rpartition("-")
        implementations = {i.value: i for i in OptimizerImplementation}
        implementation = implementations.get(tail) if head else None
        name = parse_option(OptimizerName, head if implementation else choice, "optimizer")
        return cls(params, name, implementation)

    def _step(self, param: torch.Tensor) -> None:
        # torchtune's ``optim_step``: step, then zero_grad (set_to_none=True, the default)
        opt = self._by_param[id(param)]
        if self.before_step is not None:
            self.before_step(param)
        opt.step()
        opt.zero_grad()
        self.stepped.append(param)
        if self.after_step is not None:
            self.after_step(param)

    def warm_up(self) -> None:
        """One first step of every optimizer on a zero gradient, outside any backward, so
        that the state exists (the steady state of a step after the first)."""
        for p, opt in zip(self.params, self.optimizers, strict=True):
            p.grad = torch.zeros_like(p)
            opt.step()
            opt.zero_grad()

    def state_tensors(self) -> Iterator[tuple[torch.Tensor, str, torch.Tensor]]:
        """(parameter, key, tensor) for every tensor of every optimizer's state."""
        for p, opt in zip(self.params, self.optimizers, strict=True):
            for key, value in opt.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    yield p, key, value

    def hooked(self) -> _Hooks:
        """A context in which each parameter's hook is registered (removed on exit: the
        profiler's fake parameters are shared by later runs)."""
        return _Hooks(self)


class _Hooks:
    def __init__(self, stepper: OptimizerInBackward) -> None:
        self.stepper = stepper
        self.handles: list[Any] = []

    def __enter__(self) -> OptimizerInBackward:
        self.handles = [
            p.register_post_accumulate_grad_hook(self.stepper._step) for p in self.stepper.params
        ]
        return self.stepper

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def zero_grads_in_place(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients a step with ``zero_grad(set_to_none=False)`` starts with: each trainable
    parameter's ``.grad`` as zeros (made where it is None), as the previous step's
    ``zero_grad`` leaves them (``torch/optim/optimizer.py``, ``Optimizer.zero_grad``: with
    ``set_to_none=False`` it calls ``torch._foreach_zero_`` on the existing gradients and
    allocates nothing). Returns them."""
    grads = []
    for p in params:
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    return grads
