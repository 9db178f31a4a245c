"""The scalars a training loop carries from one step into the next.

Hugging Face's ``Trainer`` (transformers/trainer.py, 5.x: ``Trainer._run_epoch``, the loop of
``_inner_training_loop``) keeps two loop variables between its steps: ``tr_loss_step =
self.training_step(...)``, the last micro-batch's loss (``training_step`` returns
``loss.detach()``, the same storage), replaced when the next micro-batch's ``training_step``
returns, after its backward; and ``grad_norm``, the total norm ``clip_grad_norm_`` returned,
set to None right before the next step's clipping and replaced by its result. So a steady-state
step starts with the previous step's loss and norm alive, and ends holding its own.

The profiler cannot have the previous step's scalars (it runs one step), so it makes each
where the real one would be freed, outside any recording, as a resident tensor of the same
size, and drops it there: the same bytes from the step's start to that point.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["CarriedScalars"]


class CarriedScalars:
    """The loss and the gradient norm a training loop holds between steps.

    Parameters
    ----------
    register : callable, optional
        Where the previous step's scalar does not exist (the profiler's one step), called with
        a tensor of its size, made outside every dispatch mode, before it is dropped: the
        profiler registers it as resident. None: nothing stands in for it (``measure``'s first
        step, after which the real ones are carried).

    Examples
    --------
    >>> carried = CarriedScalars()
    >>> carried.replace_loss(torch.tensor(2.0))
    >>> carried.replace_norm([torch.ones(3)])  # before clipping: the previous norm goes
    >>> carried.hold_norm(torch.tensor(1.5))
    >>> [t.item() for t in carried.tensors()]
    [2.0, 1.5]
    """

    def __init__(self, register: Callable[[torch.Tensor], object] | None = None) -> None:
        self.loss: torch.Tensor | None = None
        self.norm: torch.Tensor | None = None
        self.register = register

    def _stand_in(self, dtype: torch.dtype) -> None:
        if self.register is None:
            return
        with _disable_current_modes():
            stand_in = torch.empty((), dtype=dtype)
        self.register(stand_in)
        del stand_in  # the previous step's scalar, freed here

    def replace_loss(self, loss: torch.Tensor) -> None:
        """After a micro-batch's backward: its loss replaces the one held (freed here)."""
        if self.loss is None:
            self._stand_in(loss.dtype)
        self.loss = loss

    def replace_norm(self, grads: Sequence[torch.Tensor]) -> None:
        """Right before clipping: the norm held is dropped (``grad_norm = None``). Its dtype
        is the gradients' promoted one, the dtype ``clip_grad_norm_``'s total norm has."""
        if self.norm is None and grads:
            self._stand_in(functools.reduce(torch.promote_types, [g.dtype for g in grads]))
        self.norm = None

    def hold_norm(self, norm: torch.Tensor) -> None:
        """The step's norm, held into the next step."""
        self.norm = norm

    def tensors(self) -> list[torch.Tensor]:
        """The scalars held now."""
        return [t for t in (self.loss, self.norm) if t is not None]
