"""The collectives a rank's step issues, recorded on PyTorch's fake process group.

A tensor-, expert- or pipeline-parallel rank's step runs on fake tensors over the fake
process group (``tensor_parallel.fake_process_group``), which moves nothing; every
collective still goes through the dispatcher as an op, where :class:`CollectiveLog` (a
``TorchDispatchMode``) reads its kind, payload and group. Two families reach it:

- the functional collectives DTensor's redistributions call
  (torch/distributed/_functional_collectives.py: ``torch.ops._c10d_functional.*``, the
  group named by its last argument);
- the c10d ops behind ``torch.distributed``'s own calls (``dist.all_reduce`` in
  transformers' rowwise layers, the point-to-point messages of
  ``torch.distributed.pipelining``): ``torch.ops.c10d.*``, whose group argument is the
  process group itself (torch/csrc/distributed/c10d/Ops.cpp).

Each becomes a ``communication.Collective``; its payload is read from the tensors' shapes
and dtypes (fake tensors carry both).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .._estimating.communication import Collective, CollectiveKind

__all__ = ["CollectiveLog", "collective_of", "collectives_recorded"]

K = CollectiveKind

# op name (``namespace::name`` without the overload) -> its kind
_FUNCTIONAL = {
    "_c10d_functional::all_reduce": K.ALL_REDUCE,
    "_c10d_functional::all_reduce_": K.ALL_REDUCE,
    "_c10d_functional::all_reduce_coalesced": K.ALL_REDUCE,
    "_c10d_functional::all_reduce_coalesced_": K.ALL_REDUCE,
    "_c10d_functional::all_gather_into_tensor": K.ALL_GATHER,
    "_c10d_functional::all_gather_into_tensor_out": K.ALL_GATHER,
    "_c10d_functional::all_gather_into_tensor_coalesced": K.ALL_GATHER,
    "_c10d_functional::reduce_scatter_tensor": K.REDUCE_SCATTER,
    "_c10d_functional::reduce_scatter_tensor_coalesced": K.REDUCE_SCATTER,
    "_c10d_functional::all_to_all_single": K.ALL_TO_ALL,
    "_c10d_functional::broadcast": K.BROADCAST,
    "_c10d_functional::broadcast_": K.BROADCAST,
}
_C10D = {
    "c10d::allreduce_": K.ALL_REDUCE,
    "c10d::allreduce_coalesced_": K.ALL_REDUCE,
    "c10d::allgather_": K.ALL_GATHER,
    "c10d::_allgather_base_": K.ALL_GATHER,
    "c10d::allgather_coalesced_": K.ALL_GATHER,
    "c10d::allgather_into_tensor_coalesced_": K.ALL_GATHER,
    "c10d::reduce_scatter_": K.REDUCE_SCATTER,
    "c10d::_reduce_scatter_base_": K.REDUCE_SCATTER,
    "c10d::reduce_scatter_tensor_coalesced_": K.REDUCE_SCATTER,
    "c10d::alltoall_": K.ALL_TO_ALL,
    "c10d::alltoall_base_": K.ALL_TO_ALL,
    "c10d::broadcast_": K.BROADCAST,
    "c10d::send": K.SEND,
    "c10d::recv_": K.RECV,
    "c10d::recv_any_source_": K.RECV,
}


def _nbytes(t: object) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


def _group(name_or_group: object) -> Any:
    """The process group a functional collective names, or a c10d op passes itself (as
    the dispatcher's boxed ``ScriptObject``, which ``ProcessGroup.unbox`` opens)."""
    import torch.distributed as dist

    if isinstance(name_or_group, str):
        from torch._C._distributed_c10d import _resolve_process_group

        return _resolve_process_group(name_or_group)  # type: ignore[arg-type]
    if isinstance(name_or_group, dist.ProcessGroup):
        return name_or_group
    return dist.ProcessGroup.unbox(name_or_group)  # type: ignore[arg-type]


def _functional(name: str, kind: CollectiveKind, args: tuple[Any, ...]) -> Collective:
    """A functional collective's record (schemas: torch/csrc/distributed/c10d/Functional.cpp)."""
    group = _group(args[-1])
    size, rank = int(group.size()), int(group.rank())
    payload = _nbytes(args[0])
    own = 0
    if kind is K.ALL_GATHER:  # (input, group_size, group_name): the gathered output
        payload *= size
    elif kind is K.ALL_TO_ALL:  # (input, output_split_sizes, input_split_sizes, group_name)
        splits = args[2]
        rows = args[0].shape[0] if args[0].dim() else 1
        own = payload * int(splits[rank]) // max(rows, 1) if splits else payload // size
    return Collective(kind, payload, size, own)


def _c10d(name: str, kind: CollectiveKind, args: tuple[Any, ...]) -> Collective:
    """A c10d op's record (schemas: torch/csrc/distributed/c10d/Ops.cpp)."""
    if kind in (K.ALL_REDUCE, K.BROADCAST, K.SEND, K.RECV):  # (tensors, process_group, ...)
        group = args[1]
        payload = _nbytes(args[0])
    else:  # (outputs, inputs, process_group, ...)
        group = args[2]
        gathered, scattered = _nbytes(args[0]), _nbytes(args[1])
        payload = {K.ALL_GATHER: gathered, K.REDUCE_SCATTER: scattered}.get(kind, scattered)
    group = _group(group)
    size, rank = int(group.size()), int(group.rank())
    own = 0
    if kind is K.ALL_TO_ALL:
        if name == "c10d::alltoall_base_" and args[4]:  # (out, in, pg, out_splits, in_splits)
            rows = args[1].shape[0] if args[1].dim() else 1
            own = payload * int(args[4][rank]) // max(rows, 1)
        elif name == "c10d::alltoall_":  # (outputs, inputs, pg): one input per rank
            own = _nbytes(args[1][rank])
        else:
            own = payload // size
    return Collective(kind, payload, size, own)


# op overload -> (its name, whether functional) for the collectives, None for every other
# op: filled as ops are first seen, so that each later op costs one dictionary look-up
_SEEN: dict[Any, tuple[str, bool] | None] = {}


def collective_of(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> Any:
    """The ``communication.Collective`` that the op ``func`` issues with these arguments,
    or None for an op that is no collective."""
    if func in _SEEN:
        known = _SEEN[func]
    else:
        name = func._schema.name
        known = (name, True) if name in _FUNCTIONAL else (name, False) if name in _C10D else None
        _SEEN[func] = known
    if known is None:
        return None
    name, functional = known
    placed = _positional(func, args, kwargs or {})
    if functional:
        return _functional(name, _FUNCTIONAL[name], placed)
    return _c10d(name, _C10D[name], placed)


def _positional(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The op's arguments in schema order, keywords placed."""
    if not kwargs:
        return tuple(args)
    names = [a.name for a in func._schema.arguments]
    out = list(args)
    for name in names[len(args) :]:
        if name not in kwargs:
            break
        out.append(kwargs[name])
    return tuple(out)


class CollectiveLog(TorchDispatchMode):
    """Records every collective that dispatches through it, in order (``collectives``);
    the op runs as it would without it. (A profiled run records its collectives in its
    recorder instead: ``Recorder.collectives``.)"""

    def __init__(self) -> None:
        super().__init__()
        self.collectives: list[Collective] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        collective = collective_of(func, args, kwargs)
        if collective is not None:
            self.collectives.append(collective)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def collectives_recorded() -> Iterator[CollectiveLog]:
    """A :class:`CollectiveLog` on while inside (the innermost mode: enter it after the
    fake mode and the recorder, so that it sees each op first)."""
    log = CollectiveLog()
    with log:
        yield log
