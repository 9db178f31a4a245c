"""The real ``torch.compile`` step (default Inductor backend), for ``measure``.

``measure(compile=...)`` compiles its own copy of the model, never the model passed in:
``torch.compile(copy)`` (an ``OptimizedModule`` around the copy) for the whole model, or
``block.compile(fullgraph=True)`` on each repeated block of the copy (``CompileScope``).
Dynamo's caches are reset before and after, so that each measurement compiles afresh and
leaves nothing behind, and ``torch._functorch.config.activation_memory_budget`` is patched
for the run (``config.patch`` restores it). The warm-up iteration compiles (forward and, at
its first backward, the backward graph), so compilation's own allocations precede the
measured iteration.

The saved activations of a step are read around the model's forward (``WatchedForward``):
the bytes alive when it returns less those alive when it was called, less the storages of
its outputs. On the CPU the allocator's events inside the forward's
``record_function`` range give the first; Inductor's buffers (``empty_strided_cpu`` in the
generated code) go through the same CPU allocator and are among them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .._estimating.compiled import CompileScope
from .._estimating.levers import repeated_blocks
from .tensor_parallel import local_part

__all__ = [
    "FORWARD_MARKER",
    "WatchedForward",
    "compiled_forward",
    "compiled_run",
    "fsdp_blocks_refusal",
    "output_tensors",
    "storage_bytes_of",
]

# The name of the record_function range around each forward call of the model (CPU).
FORWARD_MARKER = "vram_widget.measure:forward"


def compiled_forward(model: torch.nn.Module, scope: CompileScope) -> Callable[..., Any]:
    """The forward of ``model`` (measure's copy) compiled as ``scope`` asks.

    ``MODEL``: ``torch.compile(model)``, which wraps the module and leaves it as it was.
    ``BLOCKS``: each of the copy's repeated blocks (``levers.repeated_blocks``: the
    children of its largest ``ModuleList`` of one class) compiled in place with
    ``Module.compile(fullgraph=True)`` (torch/nn/modules/module.py: it sets the module's
    ``_compiled_call_impl``), the rest of the model eager.
    """
    from .compiled_graphs import BACKEND

    backend = BACKEND.get("inductor")  # a GraphCapture inside compiled_graphs.captured_graphs
    if scope is CompileScope.MODEL:
        return torch.compile(model, backend=backend)
    modules = dict(model.named_modules())
    names = repeated_blocks(tuple(modules), tuple(type(m).__name__ for m in modules.values()))
    if not names:
        raise ValueError(
            f"compile='blocks' compiles each repeated block (the children of a ModuleList "
            f"of one class) on its own, and {type(model).__name__} has no such list; use "
            "compile=True to compile the whole model"
        )
    for name in names:
        modules[name].compile(backend=backend, fullgraph=True)
    return model


def fsdp_blocks_refusal(model: torch.nn.Module) -> str:
    """Why ``compile="blocks"`` cannot run under FSDP2 for ``model`` ("" where it can, or
    where it has no repeated blocks: ``compiled_forward`` says so).

    ``fully_shard`` registers forward hooks on each block that dynamo does not trace
    (torch/distributed/fsdp/_fully_shard/_fsdp_common.py: ``_dynamo_disable``), so the
    compiled ``_call_impl`` of a block breaks at them, its frame is skipped and dynamo
    compiles the block's ``forward`` as a frame of its own, with FSDP2's hooks eager
    around it. Where that ``forward`` is torch's own code (``torch.nn.
    TransformerEncoderLayer``), dynamo's skip list leaves it uncompiled: it lets in a
    ``torch.nn`` class's forward only while the module has hooks and its class is
    defined in ``torch.nn`` (torch/_dynamo/trace_rules.py, ``check_verbose``), and
    ``fully_shard`` swaps the block's class for ``FSDP<name>``, defined in
    torch.distributed.fsdp (``_fsdp_init._apply_to_module``); with ``fullgraph=True`` the
    call then fails ("torch.compile with fullgraph=True found no compiled frames"), as
    torchtitan's ``apply_compile`` would.
    """
    from torch._dynamo import trace_rules

    modules = dict(model.named_modules())
    names = repeated_blocks(tuple(modules), tuple(type(m).__name__ for m in modules.values()))
    if not names:
        return ""
    cls = type(modules[names[0]])
    code = getattr(getattr(cls, "forward", None), "__code__", None)
    if code is None or not trace_rules.check(code):
        return ""
    return (
        f"each {cls.__name__}'s forward is torch's own code, which dynamo skips once "
        "fully_shard has wrapped the block (FSDP2's hooks are not traced, so dynamo "
        "compiles the block's forward as a frame of its own, and torch.nn's forward is in "
        "its skip list unless the module's class is torch.nn's, where fully_shard's "
        f"FSDP{cls.__name__} is not): with fullgraph=True nothing is compiled"
    )


@contextlib.contextmanager
def compiled_run(scope: CompileScope | None, budget: float | None) -> Iterator[None]:
    """Fresh dynamo caches, the partitioner's budget patched, and dynamo's and Inductor's
    failures turned into a ValueError that gives their reason (no compiler traceback)."""
    if scope is None:
        yield
        return
    from torch._functorch import config as functorch_config

    patch = (
        functorch_config.patch(activation_memory_budget=budget)
        if budget is not None
        else contextlib.nullcontext()
    )
    torch._dynamo.reset()
    try:
        with patch:
            yield
    except Exception as exc:
        reason = _compiler_reason(exc)
        if reason is None:
            raise
        raise ValueError(
            f"torch.compile (compile={scope.value!r}) could not compile this model: {reason}"
        ) from None
    finally:
        torch._dynamo.reset()


# Why a per-block compile stops (torch/_dynamo/convert_frame.py raises
# FailOnRecompileLimitHit where a frame compiled with fullgraph=True needs more graphs than
# torch._dynamo.config.recompile_limit, default 8). Dynamo guards on the int attributes a
# block's forward reads (Hugging Face's ``layer_idx``: transformers' GPT2Attention reads
# ``self.layer_idx``), so each block of one class needs a graph of its own. torchtitan's
# ``apply_compile`` compiles each block with ``fullgraph=compile_config.fullgraph`` and
# fails the same way; torchtune's ``compile_model`` (``m.compile(backend=backend)``, no
# fullgraph) runs the blocks past the limit eagerly instead.
_RECOMPILE_LIMIT = (
    "each repeated block needs a graph of its own (dynamo guards on attributes its forward "
    "reads, such as a layer index), and past torch._dynamo.config.recompile_limit "
    "({limit}) fullgraph=True stops (FailOnRecompileLimitHit), as torchtitan's per-block "
    "compile does; compile=True compiles the whole model once"
)


# torch/_dynamo/eval_frame.py (compile_wrapper) raises a plain RuntimeError when a
# fullgraph=True compile traced no frame at all: a block that is one of torch's own
# modules (nn.TransformerEncoderLayer) has every frame of its forward in dynamo's skip list
# when it is compiled on its own; reached from a model's own forward, dynamo inlines it.
_NO_FRAMES = "torch.compile with fullgraph=True found no compiled frames"


def _no_frames_reason(text: str) -> str:
    """Dynamo's "no compiled frames" message in one line: its head, the first skipped
    frame and what to use instead."""
    skipped = [line.strip(" -") for line in text.splitlines()[1:] if line.strip()]
    first = f" (first: {skipped[0]})" if skipped else ""
    return (
        f"{_NO_FRAMES}{first}: each frame of the block's forward is in dynamo's skip list, as "
        "torch's own modules compiled on their own are; compile=True compiles the whole "
        "model, whose forward reaches them from traced code"
    )


def _compiler_reason(exc: BaseException) -> str | None:
    """Dynamo's (or Inductor's) own message for a compile failure, up to its first blank
    line (where its developer context and links start); None for any other exception."""
    from torch._dynamo.exc import TorchDynamoException

    failures: tuple[type[BaseException], ...] = (TorchDynamoException,)
    with contextlib.suppress(ImportError, AttributeError):
        from torch._inductor.exc import InductorError

        failures = (*failures, InductorError)
    # FailOnRecompileLimitHit derives from Exception, not TorchDynamoException
    if type(exc).__name__ == "FailOnRecompileLimitHit":
        return _RECOMPILE_LIMIT.format(limit=torch._dynamo.config.recompile_limit)
    if type(exc) is RuntimeError and str(exc).startswith(_NO_FRAMES):
        return _no_frames_reason(str(exc))
    if not isinstance(exc, failures):
        return None
    text = str(exc).strip()
    head = text.split("\n\n", 1)[0].strip()
    return (
        " ".join(line.strip() for line in head.splitlines() if line.strip()) or type(exc).__name__
    )


def output_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors a forward's output holds: in tuples, lists and dicts (Hugging Face's
    ``ModelOutput`` is a dict), and in the attributes of other objects (its KV cache, e.g.
    ``DynamicCache``'s layers), each object visited once; modules are not entered."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif id(item) in seen or isinstance(item, (torch.nn.Module, str, bytes, type)):
            continue
        elif isinstance(item, dict):
            seen.add(id(item))
            stack.extend(item.values())
        elif isinstance(item, (tuple, list, set)):
            seen.add(id(item))
            stack.extend(item)
        elif hasattr(item, "__dict__"):
            seen.add(id(item))
            stack.extend(vars(item).values())
    return found


def storage_bytes_of(value: Any) -> int:
    """The bytes of the unique storages of the (strided) tensors a forward's output holds
    (``output_tensors``)."""
    seen: dict[int, int] = {}
    for t in output_tensors(value):
        if t.layout is torch.strided:
            storage = local_part(t).untyped_storage()  # a DTensor's: its local shard's
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


class WatchedForward:
    """The model's forward, inside a ``record_function`` range (``FORWARD_MARKER``),
    appending the bytes of each call's output storages to ``output_bytes`` (a list the
    caller keeps, so that it outlives the model copy)."""

    def __init__(self, forward: Callable[..., Any], output_bytes: list[int]) -> None:
        self.forward = forward
        self.output_bytes = output_bytes

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autograd.profiler.record_function(FORWARD_MARKER):
            out = self.forward(*args, **kwargs)
        self.output_bytes.append(storage_bytes_of(out))
        from .compiled_graphs import BACKEND, GraphCapture

        capture = BACKEND.get(None)
        if isinstance(capture, GraphCapture):
            capture.note_forward((args, kwargs), out)
        return out
