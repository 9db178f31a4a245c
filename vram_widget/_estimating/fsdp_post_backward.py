"""FSDP2's post-backward beyond its plain rules (``sharding.fsdp_step_edits``): a
tensor-parallel gradient redistributed to its parameter's placements, and the gradient
seed that outlives the final backward callback."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from .options import CATEGORY_CODE, PHASE_CODE, Category, Phase

if TYPE_CHECKING:
    from .sharding import FsdpParam, _Inserts


def redistributed_grads(
    unit_params: Sequence[FsdpParam],
    grads: Sequence[tuple[int, int, int, int]],
    ins: _Inserts,
    at: int,
) -> list[tuple[int, int, int, int]]:
    """The unit's gradients as ``foreach_reduce`` takes them, each a DTensor gradient whose
    placements differ from its parameter's redistributed first.

    FSDP2's ``post_backward`` reads each unsharded gradient through
    ``FSDPParam.unsharded_grad_data`` (``_get_grad_inner_tensor``,
    torch/distributed/fsdp/_fully_shard/_fsdp_param.py): a tensor-parallel parameter's
    gradient whose placements are not the parameter's (``_unsharded_dtensor_spec``) is
    ``grad.redistribute(placements=...)``, a new local tensor of the parameter's local
    shape (``Replicate`` to ``Shard``: DTensor's chunk then ``clone``), and the loop then
    sets ``unsharded_param.grad = None``, which frees the old one, all before ``reshard``.
    Such a gradient is the only one on its row whose bytes are not its parameter's (a
    plain parameter's gradient, or a DTensor's of the same placements, is its size);
    gradients not matched so are left as they are. Returns ``grads`` with each
    redistributed one replaced by its new storage ``(sid, bytes, row, at)``."""
    trainable = [p for p in unit_params if p.trainable]
    local = list(grads)
    for p in trainable:
        nbytes = int(np.prod(p.shape, dtype=np.int64)) * p.gathered_itemsize
        on_row = [i for i, g in enumerate(local) if g[2] == p.row]
        if len(on_row) != 1 or sum(q.row == p.row for q in trainable) != 1:
            continue
        sid, old, row, _when = local[on_row[0]]
        if old == nbytes:
            continue
        new = ins.alloc(at, nbytes, Category.GRADIENT, row, Phase.BACKWARD)
        ins.free(at, old, Category.GRADIENT, row, Phase.BACKWARD, sid)
        local[on_row[0]] = (new, nbytes, row, at)
    return local


def hold_seeds(
    ins: _Inserts, seed_frees: Sequence[tuple[int, int, int, int]], b0: int, b1: int
) -> list[tuple[int, int, int, int]]:
    """Undo the free of the gradient seed of the backward ``[b0, b1)`` (``seed_frees``:
    ``(storage id, bytes, row, index of its free)``, a Temporary) right after it; called
    before any other edit of the micro-batch, so that the undo comes first at its position
    (the final callback's edits may share it). :func:`release_seeds` frees them after
    FSDP2's final callback: the single-device timeline frees the seed within the backward,
    but ``torch.autograd.backward`` holds it in ``grad_tensors_``
    (torch/autograd/__init__.py) until the engine returns, which is after the callbacks
    queued on it have run (``Variable._execution_engine.queue_callback``, FSDP2's
    ``_root_post_backward_final_callback``, _fsdp_state.py)."""
    held = [s for s in seed_frees if b0 <= s[3] < b1]
    for sid, nbytes, row, j in held:
        ins.cols.append((j + 1, nbytes, CATEGORY_CODE[Category.TEMPORARY], row,
                         PHASE_CODE[Phase.BACKWARD], sid))  # fmt: skip
    return held


def release_seeds(ins: _Inserts, held: Sequence[tuple[int, int, int, int]], b1: int) -> None:
    """Free the seeds :func:`hold_seeds` kept, at ``b1`` after everything inserted there
    before (the final callback), as ``backward()`` returns."""
    for sid, nbytes, row, _j in held:
        ins.free(b1, nbytes, Category.TEMPORARY, row, Phase.BACKWARD, sid)
