"""A stack of identical blocks recorded with a few of them, the whole stack derived exactly.

Most large models run N copies of one block (``model.layers``: a ``ModuleList`` of N
``LlamaDecoderLayer``), and a fake step records the same events for each, shifted: the same
ops, the same bytes, its own storages. So a run of the model with 3 blocks and one with 4
(meta copies: the model itself is never touched) give the step with N blocks: the events of
a middle block repeated N - 2 times between those of the first and the last block.

It is used only where that is checked, to the byte, for the run asked: the run with 4 blocks
must be the run with 3 with one middle block's events inserted, and its two middle blocks'
events the same as each other (every event's bytes, phase, op, module and storage, each
storage's size, category and owner, the FLOPs and output shapes of every module). Where the
blocks differ in anything their code reads (a parameter's shape or dtype, a non-tensor
attribute other than their own index, a hook, a per-layer list in the model's config, such
as ``layer_types``), the shortcut is not tried. Either way, the full run is made instead.

Event streams are compared in a relative form. Each event names its module and its
storage relative to the block it happens in (``+0: self_attn.q_proj``, ``-1``: the block
before); events outside the blocks name a block's storage from the first or the last block.
A storage is named by the block that allocated it and its rank among that block's storages,
and its creation is a token of the stream too, so the derived run numbers its storages in
the order the full run creates them.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._estimating.levers import Levers
from .._estimating.options import PHASE_CODE, Phase

# A stack shorter than this is run in full: the 3- and 4-block runs cost about as much.
MIN_BLOCKS = 8
# The block counts of the two runs the stack is derived from
FEW_BLOCKS = (3, 4)


class NotRepeated(Exception):
    """The runs with few blocks do not give the run with N exactly: run it in full."""


@dataclass(frozen=True)
class BlockStack:
    """Where a model's repeated blocks are: ``path`` (``"model.layers"``) and how many."""

    path: str
    count: int


# -- finding the stack ------------------------------------------------------------------------
_SKIPPED_ATTRIBUTES = frozenset({"training", "_is_hf_initialized"})
_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
)


def _signature(block: torch.nn.Module) -> list[Any]:
    """What a block's code can read: each submodule's type, hooks, parameters' and
    buffers' shapes, strides, dtypes and ``requires_grad``, and its other attributes
    (compared by value, else by identity)."""
    out: list[Any] = []
    for name, mod in block.named_modules(remove_duplicate=False):
        out.append((name, type(mod)))
        for hooks in _HOOK_DICTS:
            out.append(len(getattr(mod, hooks, {}) or {}))
        for pname, p in mod._parameters.items():
            out.append(
                (pname, None)
                if p is None
                else (pname, tuple(p.shape), p.stride(), p.dtype, p.requires_grad)
            )
        for bname, b in mod._buffers.items():
            out.append((bname, None) if b is None else (bname, tuple(b.shape), b.dtype))
        for key, value in sorted(vars(mod).items()):
            if key in ("_parameters", "_buffers", "_modules") or key in _SKIPPED_ATTRIBUTES:
                continue
            if key in _HOOK_DICTS or "_hooks" in key:  # counted above
                continue
            out.append((key, _value(value)))
    return out


def _same_blocks(blocks: list[torch.nn.Module]) -> bool:
    """Whether the blocks' signatures are the same, but for attributes that hold each
    block's own index (``layer_idx``)."""
    signatures = [_signature(b) for b in blocks]
    if any(len(sig) != len(signatures[0]) for sig in signatures):
        return False
    for entries in zip(*signatures, strict=True):
        if all(e == entries[0] for e in entries):
            continue
        key = entries[0][0]
        if not all(e == (key, index) for index, e in enumerate(entries)):
            return False
    return True


def _value(value: Any) -> Any:
    """An attribute as compared between blocks: plain values and containers of them by
    value, anything else by identity (a config object the blocks share)."""
    if isinstance(value, (bool, int, float, str, type(None), torch.dtype, torch.device)):
        return value
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_value(v) for v in value))
    if isinstance(value, (set, frozenset)):
        return (type(value), frozenset(_value(v) for v in value))
    if isinstance(value, dict):
        return (type(value), tuple((k, _value(v)) for k, v in value.items()))
    return ("id", id(value))


def _config_varies(model: torch.nn.Module, count: int) -> bool:
    """Whether the model's config holds a per-layer list whose entries differ
    (``layer_types`` of Qwen2 and Gemma: sliding or full attention per layer, read by
    index in the forward)."""
    config = getattr(model, "config", None)
    if config is None:
        return False
    for value in vars(config).values():
        sized = isinstance(value, (list, tuple)) and len(value) == count
        if sized and any(v != value[0] for v in value):
            return True
    return False


def find_stack(model: torch.nn.Module) -> BlockStack | None:
    """The model's longest ``ModuleList`` of at least ``MIN_BLOCKS`` blocks whose
    signatures (``_signature``) are all the same, owning their parameters alone; None
    where there is none."""
    best: BlockStack | None = None
    seen: dict[int, int] = {}
    for _name, mod in model.named_modules(remove_duplicate=False):
        seen[id(mod)] = seen.get(id(mod), 0) + 1
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.ModuleList) or len(mod) < MIN_BLOCKS:
            continue
        if best is not None and len(mod) <= best.count:
            continue
        blocks = list(mod)
        if any(type(b) is not type(blocks[0]) for b in blocks):
            continue
        # a block used twice, or a parameter shared between blocks, is no stack of copies
        if any(seen.get(id(m), 0) > 1 for b in blocks for m in b.modules()):
            continue
        owners: dict[int, int] = {}
        shared = False
        for i, b in enumerate(blocks):
            for t in (*b.parameters(), *b.buffers()):
                if owners.setdefault(id(t), i) != i:
                    shared = True
        if shared:
            continue
        if not _same_blocks(blocks):
            continue
        if _config_varies(model, len(blocks)):
            continue
        best = BlockStack(name, len(blocks))
    return best


def reduced_copy(model: torch.nn.Module, stack: BlockStack, n: int) -> torch.nn.Module:
    """A meta copy of ``model`` (as ``step.meta_copy`` makes one) with the first ``n``
    blocks of its stack only (the others neither copied nor touched)."""
    blocks = model.get_submodule(stack.path)
    assert isinstance(blocks, torch.nn.ModuleList)
    dropped = list(blocks)[n:]
    skipped = {id(t) for b in dropped for t in (*b.parameters(), *b.buffers())}
    memo: dict[int, Any] = {id(b): None for b in dropped}
    for t in (*model.parameters(), *model.buffers()):
        if id(t) in memo or id(t) in skipped:
            continue
        meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        if isinstance(t, torch.nn.Parameter):
            meta = torch.nn.Parameter(meta, requires_grad=t.requires_grad)
        memo[id(t)] = meta
    copied = copy.deepcopy(model, memo)
    kept = copied.get_submodule(stack.path)
    for key in list(kept._modules)[n:]:
        del kept._modules[key]
    return copied


# -- levers -----------------------------------------------------------------------------------
def _block_names(names: tuple[str, ...], stack: BlockStack) -> dict[int, set[str]] | None:
    per: dict[int, set[str]] = {}
    prefix = stack.path + "."
    for name in names:
        if name.startswith(prefix):
            index, _, rest = name[len(prefix) :].partition(".")
            if not index.isdigit():
                return None
            per.setdefault(int(index), set()).add(rest)
    return per


def reduced_names(names: tuple[str, ...], stack: BlockStack, n: int) -> tuple[str, ...] | None:
    """``names`` (of modules or parameters) for the copy with ``n`` blocks, where every
    block has the same ones; None where blocks differ."""
    per = _block_names(names, stack)
    if per is None:
        return None
    if per:
        sets = [frozenset(per.get(i, set())) for i in range(stack.count)]
        if any(s != sets[0] for s in sets):
            return None
    prefix = stack.path + "."
    kept = [
        name
        for name in names
        if not name.startswith(prefix) or int(name[len(prefix) :].partition(".")[0]) < n
    ]
    return tuple(kept)


def reduced_levers(levers: Levers, stack: BlockStack, n: int) -> Levers | None:
    """``levers`` for the copy with ``n`` blocks; None where they cannot be carried over
    (a lever that differs between blocks, or one the derivation does not cover: an
    optimizer in the backward, activation offloading, every k-th block checkpointed)."""
    if levers.in_backward is not None or levers.offload_activations is not None:
        return None
    if levers.lora_rank is not None or isinstance(levers.checkpoint_policy, int):
        return None
    checkpoint = reduced_names(levers.checkpoint, stack, n)
    if checkpoint is None:
        return None
    trainable = levers.trainable
    if trainable is not None:
        trainable = reduced_names(trainable, stack, n)
        if trainable is None:
            return None
    return dataclasses.replace(levers, checkpoint=checkpoint, trainable=trainable)


# -- deriving the run with N blocks -----------------------------------------------------------
_FORWARD = frozenset({PHASE_CODE[Phase.FORWARD], PHASE_CODE[Phase.INFERENCE]})
_BLOCK_NAME = re.compile(r"^(\d+)(?:\.(.*))?$")


@dataclass(frozen=True)
class _Layout:
    """The rows of one copy: each row's block (-1 outside the stack) and its name
    relative to its block (its full name outside)."""

    block: tuple[int, ...]
    key: tuple[str, ...]
    count: int


def layout(names: tuple[str, ...], stack: BlockStack, count: int) -> _Layout:
    prefix = stack.path + "."
    blocks, keys = [], []
    for name in names:
        match = _BLOCK_NAME.match(name[len(prefix) :]) if name.startswith(prefix) else None
        if match is None:
            blocks.append(-1)
            keys.append(name)
        else:
            blocks.append(int(match.group(1)))
            keys.append(match.group(2) or "")
    return _Layout(tuple(blocks), tuple(keys), count)


def _where(block: int, key: str, label: int, n: int) -> tuple[Any, ...]:
    """A block's module or storage seen from a segment with ``label`` (-1: outside)."""
    if block < 0:
        return ("abs", key)
    if label >= 0:
        return ("rel", block - label, key)
    if block == 0:
        return ("first", key)
    if block == n - 1:
        return ("last", key)
    raise NotRepeated(f"outside the blocks, a reference to block {block} of {n}")


def _segments(trace: Any, lay: _Layout) -> list[tuple[int, list[tuple[Any, ...]]]]:
    """The trace as a stream of tokens (storage creations, marks, events) in relative
    form, cut into segments of one label (the block they happen in, -1 outside)."""
    n = lay.count
    module = trace.storage_module
    owner = [lay.block[m] if m >= 0 else -1 for m in module.tolist()]
    rank: list[int] = []
    counts: dict[int, int] = {}
    for o in owner:
        rank.append(counts.get(o, 0))
        counts[o] = rank[-1] + 1
    n_events = len(trace.event_bytes)
    marks: dict[int, list[str]] = {}
    for mark, at in (("backward", trace.backward_start), ("optimizer", trace.optimizer_at)):
        if at < n_events:
            marks.setdefault(at, []).append(mark)
    out: list[tuple[int, list[tuple[Any, ...]]]] = []

    def put(label: int, token: tuple[Any, ...]) -> None:
        if not out or out[-1][0] != label:
            out.append((label, []))
        out[-1][1].append(token)

    def storage(sid: int, label: int) -> tuple[Any, ...]:
        o = owner[sid]
        return ("abs", rank[sid]) if o < 0 else (*_where(o, "", label, n), rank[sid])

    def module_at(row: int, label: int) -> tuple[Any, ...]:
        return ("none",) if row < 0 else _where(lay.block[row], lay.key[row], label, n)

    def create(sid: int) -> None:
        label = owner[sid]
        row = int(module[sid])
        put(
            label,
            (
                "new",
                module_at(row, label),
                int(trace.storage_bytes[sid]),
                int(trace.storage_category[sid]),
                bool(trace.storage_resident[sid]),
            ),
        )

    pointer = 0
    context = -1
    ev_storage = trace.event_storage.tolist()
    ev_bytes = trace.event_bytes.tolist()
    ev_module = trace.event_module.tolist()
    ev_phase = trace.event_phase.tolist()
    ev_op = trace.event_op.tolist()  # codes: op_names is the same in every copy
    for i in range(n_events):
        for mark in marks.get(i, ()):
            put(-1, ("mark", mark))
        sid = ev_storage[i]
        while pointer <= sid:
            create(pointer)
            pointer += 1
        row = ev_module[i]
        label = lay.block[row] if row >= 0 else -1
        if label < 0 and owner[sid] >= 0:
            # Outside the blocks, on a block's storage: counted with the block running just
            # before where that is the next one (the model's own code letting go of the
            # block's output once the next block has run), else with that block (its
            # gradient freed by zero_grad).
            follows = context >= 0 and owner[sid] == context - 1 and ev_phase[i] in _FORWARD
            label = context if follows else owner[sid]
        context = label
        pass
        put(
            label,
            (
                "ev",
                module_at(row, label),
                storage(sid, label),
                ev_bytes[i],
                ev_phase[i],
                ev_op[i],
            ),
        )
    while pointer < len(owner):
        create(pointer)
        pointer += 1
    return out


def _expansion(three: list[tuple[int, list[Any]]], four: list[tuple[int, list[Any]]]) -> list[bool]:
    """Checks that the 4-block stream is the 3-block one with each middle-block segment
    doubled (same tokens), and gives each middle segment's direction (True: blocks in
    ascending order, the forward; False: descending, the backward)."""
    directions: list[bool] = []
    j = 0
    for label, tokens in three:
        if label == 1:
            pair = four[j : j + 2]
            if len(pair) != 2 or any(t != tokens for _l, t in pair):
                raise NotRepeated("a middle block's events differ")
            labels = (pair[0][0], pair[1][0])
            if labels not in ((1, 2), (2, 1)):
                raise NotRepeated("the middle blocks run out of order")
            directions.append(labels == (1, 2))
            j += 2
            continue
        expected = 3 if label == 2 else label
        if j >= len(four) or four[j] != (expected, tokens):
            raise NotRepeated("the runs with 3 and 4 blocks differ outside a middle block")
        j += 1
    if j != len(four):
        raise NotRepeated("the run with 4 blocks has more segments")
    return directions


def _expanded(
    three: list[tuple[int, list[Any]]], directions: list[bool], count: int
) -> Iterator[tuple[int, list[Any]]]:
    middles = iter(directions)
    for label, tokens in three:
        if label == 1:
            order = range(1, count - 1)
            for block in order if next(middles) else reversed(order):
                yield block, tokens
        elif label == 2:
            yield count - 1, tokens
        else:
            yield label, tokens


def derive(
    three: Any, four: Any, lay3: _Layout, lay4: _Layout, full: _Layout, full_rows: int
) -> Any:
    """The trace with ``full.count`` blocks from those with 3 and 4 (``RawTrace``s), or
    ``NotRepeated`` where the 4-block one is not the 3-block one with a block inserted."""
    for name in ("workspace_storages", "step_starts"):
        if len(getattr(three, name)) or len(getattr(four, name)):
            raise NotRepeated(name)
    if three.host_peak_bytes or four.host_peak_bytes or three.op_names != four.op_names:
        raise NotRepeated("offloaded copies, or other ops")
    if three.uses_matmul != four.uses_matmul or three.batch_size != four.batch_size:
        raise NotRepeated("matmul use")
    seg3 = _segments(three, lay3)
    directions = _expansion(seg3, _segments(four, lay4))
    count = full.count
    row_of = {(b, k): r for r, (b, k) in enumerate(zip(full.block, full.key, strict=True))}

    def row(where: tuple[Any, ...], label: int) -> int:
        kind = where[0]
        if kind == "none":
            return -1
        if kind == "abs":
            return row_of[(-1, where[1])]
        if kind == "rel":
            return row_of[(label + where[1], where[2])]
        return row_of[(0 if kind == "first" else count - 1, where[1])]

    def owner(where: tuple[Any, ...], label: int) -> int:
        kind = where[0]
        if kind == "abs":
            return -1
        if kind == "rel":
            return int(label + where[1])
        return 0 if kind == "first" else count - 1

    ids: dict[tuple[int, int], int] = {}
    ranks: dict[int, int] = {}
    s_module: list[int] = []
    s_bytes: list[int] = []
    s_category: list[int] = []
    s_resident: list[bool] = []
    e_storage: list[int] = []
    e_bytes: list[int] = []
    e_module: list[int] = []
    e_phase: list[int] = []
    e_op: list[int] = []
    marks: dict[str, int] = {}
    try:
        for label, tokens in _expanded(seg3, directions, count):
            for token in tokens:
                kind = token[0]
                if kind == "new":
                    o = label
                    k = ranks.get(o, 0)
                    ranks[o] = k + 1
                    ids[(o, k)] = len(s_bytes)
                    s_module.append(row(token[1], label))
                    s_bytes.append(token[2])
                    s_category.append(token[3])
                    s_resident.append(token[4])
                elif kind == "mark":
                    marks[token[1]] = len(e_bytes)
                else:
                    where = token[2]
                    e_storage.append(ids[(owner(where[:-1], label), where[-1])])
                    e_module.append(row(token[1], label))
                    e_bytes.append(token[3])
                    e_phase.append(token[4])
                    e_op.append(token[5])
    except KeyError as exc:
        raise NotRepeated(f"no such module or storage: {exc}") from None
    n_events = len(e_bytes)
    forward, backward, shapes = _per_row(three, four, lay3, lay4, full, full_rows)
    return dataclasses.replace(
        three,
        event_storage=np.asarray(e_storage, dtype=three.event_storage.dtype),
        event_bytes=np.asarray(e_bytes, dtype=three.event_bytes.dtype),
        event_module=np.asarray(e_module, dtype=three.event_module.dtype),
        event_phase=np.asarray(e_phase, dtype=three.event_phase.dtype),
        event_op=np.asarray(e_op, dtype=three.event_op.dtype),
        storage_category=np.asarray(s_category, dtype=three.storage_category.dtype),
        storage_module=np.asarray(s_module, dtype=three.storage_module.dtype),
        storage_resident=np.asarray(s_resident, dtype=three.storage_resident.dtype),
        storage_bytes=np.asarray(s_bytes, dtype=three.storage_bytes.dtype),
        flops_forward=forward,
        flops_backward=backward,
        output_shapes=shapes,
        backward_start=marks.get("backward", n_events),
        optimizer_at=marks.get("optimizer", n_events),
    )


def source_block(block: int, count: int) -> int:
    """The block of the 3-block copy that stands for ``block`` of ``count``."""
    return 0 if block == 0 else 2 if block == count - 1 else 1


def _per_row(
    three: Any, four: Any, lay3: _Layout, lay4: _Layout, full: _Layout, full_rows: int
) -> tuple[np.ndarray, np.ndarray, tuple[Any, ...]]:
    """FLOPs and output shapes per row of the full model, from the 3-block copy's rows
    (checked against the 4-block copy's: its two middle blocks count as the middle one)."""
    of3 = {(b, k): r for r, (b, k) in enumerate(zip(lay3.block, lay3.key, strict=True))}
    of4 = {(b, k): r for r, (b, k) in enumerate(zip(lay4.block, lay4.key, strict=True))}
    for (b, k), r4 in of4.items():
        r3 = of3.get((-1, k) if b < 0 else (source_block(b, 4), k))
        if r3 is None or (
            three.flops_forward[r3] != four.flops_forward[r4]
            or three.flops_backward[r3] != four.flops_backward[r4]
            or three.output_shapes[r3] != four.output_shapes[r4]
        ):
            raise NotRepeated("a module's FLOPs or output shape")
    forward = np.zeros(full_rows, dtype=three.flops_forward.dtype)
    backward = np.zeros(full_rows, dtype=three.flops_backward.dtype)
    shapes: list[Any] = [None] * full_rows
    for r, (b, k) in enumerate(zip(full.block, full.key, strict=True)):
        r3 = of3.get((-1, k) if b < 0 else (source_block(b, full.count), k))
        if r3 is None:
            raise NotRepeated(f"no row for {k!r}")
        forward[r] = three.flops_forward[r3]
        backward[r] = three.flops_backward[r3]
        shapes[r] = three.output_shapes[r3]
    return forward, backward, tuple(shapes)


def full_param_names(reduced: set[str], stack: BlockStack, names: list[str]) -> set[str]:
    """The full model's parameter names (``names``) that the 3-block copy's set
    ``reduced`` stands for."""
    prefix = stack.path + "."
    out = set()
    for name in names:
        if name.startswith(prefix):
            index, _, rest = name[len(prefix) :].partition(".")
            mapped = f"{prefix}{source_block(int(index), stack.count)}.{rest}"
            if mapped in reduced:
                out.add(name)
        elif name in reduced:
            out.add(name)
    return out
