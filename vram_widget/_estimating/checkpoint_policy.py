"""How each checkpointed block is checkpointed: the ``checkpoint_policy`` lever.

No torch here: the policy as asked, checked against the blocks ``checkpoint=`` resolved to,
in its canonical (hashable) form, and which blocks an every-k-th policy picks. The torch
side (``_profiling/checkpoint_policy.py``) applies it to the fake model and to
``measure()``'s real copy the same way.

Policies:

* ``"full"``: each block's whole forward is recomputed in the backward
  (``torch.utils.checkpoint``, non-reentrant), the default;
* ``"op"``: torchtitan's op-level selective activation checkpointing (``SelectiveAC`` in
  torchtitan 0.3.0's ``torchtitan/distributed/activation_checkpoint.py``): the outputs of
  matmuls, attention and a few other ops are saved, every second matmul recomputed;
* an int k: every k-th block fully checkpointed, the others not (torchtitan 0.2.0's
  ``selective_ac_option="k"``, ``_apply_layer_sac``);
* a callable ``policy(ctx, op, *args, **kwargs) -> torch.utils.checkpoint.CheckpointPolicy``:
  the user's own, given to ``torch.utils.checkpoint.create_selective_checkpoint_contexts``.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable, Sequence

__all__ = [
    "CheckpointPolicyName",
    "every_kth_block",
    "policy_label",
    "resolve_checkpoint_policy",
]


class CheckpointPolicyName(enum.StrEnum):
    """The named policies; an int (every k-th block) or a callable are the other forms."""

    FULL = "full"
    OP = "op"


CheckpointPolicyValue = CheckpointPolicyName | int | Callable[..., object]

_FORMS = (
    "'full' (each block recomputed whole), 'op' (torchtitan's op-level selective "
    "checkpointing), an int k >= 1 (every k-th block, torchtitan's selective_ac_option), or "
    "a callable policy(ctx, op, *args, **kwargs) -> torch.utils.checkpoint.CheckpointPolicy"
)


def _check_callable(policy: Callable[..., object]) -> None:
    """A policy is called as ``policy(ctx, op, *args, **kwargs)``
    (``_CachingTorchDispatchMode.__torch_dispatch__`` in torch/utils/checkpoint.py): it must
    take two positional arguments, then any positional and keyword arguments."""
    try:
        signature = inspect.signature(policy)
    except (TypeError, ValueError):  # a builtin: its signature cannot be read, let it run
        return
    params = list(signature.parameters.values())
    positional = [
        p
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    kinds = {p.kind for p in params}
    takes_two = len(positional) >= 2 or inspect.Parameter.VAR_POSITIONAL in kinds
    required = [p for p in positional[2:] if p.default is inspect.Parameter.empty]
    required += [
        p
        for p in params
        if p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is inspect.Parameter.empty
    ]
    open_ended = {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD} <= kinds
    if not (takes_two and open_ended) or required:
        name = getattr(policy, "__qualname__", type(policy).__name__)
        raise TypeError(
            f"checkpoint_policy={name}{signature}: a policy is called as "
            "policy(ctx, op, *args, **kwargs) (the op's own arguments follow) and returns a "
            "torch.utils.checkpoint.CheckpointPolicy; define it as "
            "def policy(ctx, op, *args, **kwargs)"
        )


def resolve_checkpoint_policy(value: object, blocks: Sequence[str]) -> CheckpointPolicyValue:
    """``checkpoint_policy`` checked against the blocks ``checkpoint=`` resolved to, in its
    canonical form: a :class:`CheckpointPolicyName`, an int k, or the callable itself.

    None is ``"full"``. An int must lie in 1..len(blocks) (a larger k checkpoints no block);
    a callable must take ``(ctx, op, *args, **kwargs)``.

    Examples
    --------
    >>> blocks = ("h.0", "h.1")
    >>> resolve_checkpoint_policy(None, blocks), resolve_checkpoint_policy(2, blocks)
    (<CheckpointPolicyName.FULL: 'full'>, 2)
    >>> resolve_checkpoint_policy(3, blocks)
    Traceback (most recent call last):
    ...
    ValueError: checkpoint_policy=3 checkpoints every 3rd block, and there are 2 ('h.0', ...
    """
    if value is None:
        return CheckpointPolicyName.FULL
    if isinstance(value, str):
        try:
            return CheckpointPolicyName(value)
        except ValueError:
            raise ValueError(f"checkpoint_policy={value!r}: give {_FORMS}") from None
    if isinstance(value, bool):
        raise TypeError(f"checkpoint_policy={value!r}: give {_FORMS}")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"checkpoint_policy={value}: every k-th block needs k >= 1")
        if value > len(blocks):
            shown = ", ".join(repr(b) for b in blocks[:2]) + (", ..." if len(blocks) > 2 else "")
            raise ValueError(
                f"checkpoint_policy={value} checkpoints every {_ordinal(value)} block, and "
                f"there are {len(blocks)} ({shown}): none would be checkpointed; give k <= "
                f"{len(blocks)}"
            )
        return value
    if callable(value):
        _check_callable(value)
        return value
    raise TypeError(f"checkpoint_policy={value!r}: give {_FORMS}")


def _ordinal(k: int) -> str:
    suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"{k}{suffix}"


def every_kth_block(blocks: Sequence[str], k: int) -> tuple[str, ...]:
    """The blocks an every-k-th policy checkpoints: torchtitan 0.2.0's ``_apply_layer_sac``
    (torchtitan/distributed/activation_checkpoint.py) increments a counter before it tests
    ``_layer_sac_count % ac_freq == 0``, so of the blocks in order, the k-th, 2k-th, ...
    (1-based). (Its counter is a module global, never reset: a second model built in the
    same process goes on counting; a fresh process's first model is followed here.)

    Examples
    --------
    >>> every_kth_block(("l.0", "l.1", "l.2", "l.3", "l.4"), 2)
    ('l.1', 'l.3')
    >>> every_kth_block(("l.0", "l.1"), 1)
    ('l.0', 'l.1')
    """
    return tuple(b for i, b in enumerate(blocks, start=1) if i % k == 0)


def policy_label(policy: CheckpointPolicyValue) -> str:
    """A short text for :meth:`Levers.describe`.

    Examples
    --------
    >>> policy_label(CheckpointPolicyName.OP), policy_label(2)
    ("policy 'op'", 'every 2nd block')
    """
    if isinstance(policy, CheckpointPolicyName):
        return f"policy {policy.value!r}"
    if isinstance(policy, int):
        return f"every {_ordinal(policy)} block"
    return f"policy {getattr(policy, '__qualname__', type(policy).__name__)}"
