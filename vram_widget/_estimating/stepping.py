"""How the optimizer is stepped, as levers of the profiled step (numpy-free bookkeeping).

A step whose optimizer runs in the backward (torchtune's ``optimizer_in_bwd``), or whose
``zero_grad`` keeps the gradients (``set_to_none=False``), allocates differently from the
whole backward to the end of the step, so it is profiled by a run of its own: the profiler
registers the hooks, or starts with the gradients resident, and records the real mechanism
(``_profiling/stepping.py``). This module turns a Recipe's optimizer into the
:class:`~vram_widget._estimating.levers.Levers` fields that key that run, and refuses what
does not compose.
"""

from __future__ import annotations

import dataclasses

from .levers import Levers
from .options import OptimizerImplementation, ParamGroups, StepOutputs
from .recipe import Optimizer, Step
from .sharding import Parallel

__all__ = ["IN_BACKWARD_ACCUMULATION", "protocol_levers", "stepping_levers"]

# torchtune refuses the pair (recipes/full_finetune_single_device.py, _setup: "Gradient
# accumulation is not supported with optimizer in bwd"): each parameter is stepped, and its
# gradient freed, in every backward, so no gradient is left to accumulate into.
IN_BACKWARD_ACCUMULATION = (
    "grad_accumulation > 1 cannot go with optimizer_in_backward=True: the optimizer steps "
    "each parameter, and frees its gradient, in every backward, so there is nothing to "
    "accumulate into (torchtune refuses the pair too); use grad_accumulation=1"
)


def stepping_levers(
    levers: Levers,
    optimizer: Optimizer,
    implementation: OptimizerImplementation | None,
    parallel: Parallel,
) -> Levers:
    """``levers`` with how ``optimizer`` is stepped (``set_to_none``, ``in_backward``).

    ``implementation`` is the one that runs on the profile's device (the Recipe's, else
    torch's default there). Refused, by name: optimizer in backward with gradient
    accumulation (there is nothing to accumulate into) or without an optimizer, and either
    setting with a data-parallel strategy (not modelled yet).

    Examples
    --------
    >>> from vram_widget._estimating.sharding import SINGLE_DEVICE
    >>> opt = Optimizer.parse("adamw")
    >>> opt = dataclasses.replace(opt, in_backward=True)
    >>> stepping_levers(Levers(), opt, OptimizerImplementation.FOREACH, SINGLE_DEVICE).in_backward
    'adamw-foreach'
    """
    if optimizer.set_to_none and not optimizer.in_backward:
        return levers
    asked = "optimizer_in_backward=True" if optimizer.in_backward else "set_to_none=False"
    if parallel.distributed:
        raise ValueError(
            f"{asked} with strategy={parallel.strategy.value!r} on {parallel.gpus} GPUs: not "
            "estimated yet (it is on one GPU, gpus=1)"
        )
    if not optimizer.in_backward:
        return dataclasses.replace(levers, set_to_none=False)
    if optimizer.name is None:
        raise ValueError(
            "optimizer_in_backward=True needs an optimizer to step in the backward; "
            "got optimizer=None"
        )
    if levers.grad_accumulation > 1:
        raise ValueError(IN_BACKWARD_ACCUMULATION)
    name = optimizer.name.value
    choice = name if implementation is None else f"{name}-{implementation.value}"
    return dataclasses.replace(levers, in_backward=choice)


def protocol_levers(levers: Levers, step: Step, optimizer: Optimizer, parallel: Parallel) -> Levers:
    """``levers`` with how the step treats its outputs, its loss and its gradients' norm: the
    outputs freed before the backward (``step.outputs="freed"``), the backward on a scaled
    copy of the loss (``step.loss_scaled``) and ``clip_grad_norm_`` before the optimizer
    step (``optimizer.clip_grad_norm``), and the optimizer over the Trainer's two parameter
    groups (``optimizer.param_groups="decay-split"``), each a run of its own. Refused by name
    with a data-parallel strategy (not modelled yet).

    Examples
    --------
    >>> from vram_widget._estimating.sharding import SINGLE_DEVICE
    >>> lv = protocol_levers(Levers(), Step(outputs="freed"), Optimizer(clip_grad_norm=1.0),
    ...                      SINGLE_DEVICE)
    >>> lv.outputs_freed, lv.clip_grad_norm
    (True, True)
    """
    freed = step.outputs is StepOutputs.FREED
    clip = optimizer.clip_grad_norm is not None
    scaled = step.loss_scaled
    carried = step.carried_scalars
    groups = optimizer.param_groups is ParamGroups.DECAY_SPLIT and optimizer.name is not None
    if not (freed or clip or scaled or carried or groups):
        return levers
    if parallel.distributed:
        asked = ", ".join(
            a
            for a, on in (
                ("outputs='freed'", freed),
                ("loss_scaled", scaled),
                ("carried_scalars", carried),
                ("clip_grad_norm", clip),
                ("param_groups='decay-split'", groups),
            )
            if on
        )
        raise ValueError(
            f"{asked} with strategy={parallel.strategy.value!r} on {parallel.gpus} GPUs: not "
            "estimated yet (it is on one GPU, gpus=1): recipe.with_(outputs='kept', "
            "loss_scaled=False, carried_scalars=False, clip_grad_norm=None, "
            "param_groups='one') estimates the step without them"
        )
    return dataclasses.replace(
        levers,
        outputs_freed=freed,
        loss_scaled=scaled,
        carried_scalars=carried,
        clip_grad_norm=clip,
        decay_groups=groups and levers.in_backward is None,
    )
