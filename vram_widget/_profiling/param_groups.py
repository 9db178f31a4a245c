"""The optimizer's parameter groups as Hugging Face's ``Trainer`` builds them.

``Trainer.create_optimizer`` (transformers/trainer.py, 5.x) gives the optimizer two groups:
first every trainable parameter that weight decay applies to, then every other trainable
one (``weight_decay=0.0``), each in ``model.named_parameters()`` order. Which parameters
decay is ``Trainer.get_decay_parameter_names``: not those inside an ``nn.LayerNorm``, nor
those whose lower-cased qualified name matches ``bias``, ``layernorm``, ``rmsnorm``,
``(?:^|\\.)norm(?:$|\\.)`` or ``_norm(?:$|\\.)`` (``trainer_pt_utils.get_parameter_names``).

The groups change the memory of the step: a single-tensor (for-loop) step keeps one
parameter's temporary while it makes the next one's, within a group, so the order counts;
a foreach or fused step makes its temporaries over a whole group at once.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

__all__ = ["DECAY_EXCLUDED_PATTERNS", "decay_parameter_names", "trainer_groups"]

# transformers/trainer.py, Trainer.get_decay_parameter_names (5.x)
DECAY_EXCLUDED_PATTERNS: tuple[str, ...] = (
    r"bias",
    r"layernorm",
    r"rmsnorm",
    r"(?:^|\.)norm(?:$|\.)",
    r"_norm(?:$|\.)",
)
_PATTERNS = tuple(re.compile(p) for p in DECAY_EXCLUDED_PATTERNS)


def decay_parameter_names(model: torch.nn.Module) -> set[str]:
    """The qualified names of the parameters of ``model`` that the Trainer decays.

    Examples
    --------
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
    >>> sorted(decay_parameter_names(model))
    ['0.weight']
    """
    names: set[str] = set()
    for module_name, module in model.named_modules():
        if isinstance(module, torch.nn.LayerNorm):
            continue
        for param_name, _p in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            if any(p.search(name.lower()) for p in _PATTERNS) or _in_layer_norm(model, name):
                continue
            names.add(name)
    return names


def _in_layer_norm(model: torch.nn.Module, name: str) -> bool:
    """Whether any module on the path to ``name`` is an ``nn.LayerNorm`` (the Trainer's
    recursion drops everything under one)."""
    parts = name.split(".")[:-1]
    module = model
    for part in parts:
        module = getattr(module, part)
        if isinstance(module, torch.nn.LayerNorm):
            return True
    return False


def trainer_groups(
    named: Sequence[tuple[str, torch.Tensor]], decay: set[str]
) -> list[list[torch.Tensor]]:
    """``named`` (trainable parameters, in order) as the Trainer's two groups: those in
    ``decay``, then the others (either may be empty, as the Trainer passes it).

    Examples
    --------
    >>> import torch
    >>> a, b = torch.zeros(1), torch.zeros(2)
    >>> [len(g) for g in trainer_groups([("w", a), ("norm.weight", b)], {"w"})]
    [1, 1]
    """
    return [[p for n, p in named if n in decay], [p for n, p in named if n not in decay]]
