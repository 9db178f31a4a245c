"""The graphs ``torch.compile`` partitions a step into, run eagerly (a private prototype).

``GraphCapture`` is a ``torch.compile`` backend that is Inductor up to its code generation:
``torch._inductor.compile_fx.compile_fx`` with its ``inner_compile`` replaced. Dynamo's
graph goes through Inductor's own pre-grad passes, decompositions
(``select_decomp_table``), joint-graph passes and partitioner
(``min_cut_rematerialization_partition``, under
``torch._functorch.config.activation_memory_budget``), so the forward and backward graphs it
receives (torch/_inductor/compile_fx.py: ``compile_fx_forward`` / ``compile_fx_backward``
call ``inner_compile``) are the ones Inductor would generate kernels for. By default each
graph is run node by node (``torch.fx.Interpreter.boxed_run``: its inputs list is cleared,
each value dropped after its last use), so the saved set is Inductor's and the temporaries
are eager ATen's. ``GraphCapture(generated=True)`` (the profile's) runs Inductor's generated
code for each graph instead (``compiled_inductor.py``), on fake tensors, so the temporaries
are Inductor's too; a graph whose code cannot be generated or run there runs node by node,
and ``fallbacks`` says why.

The saved set of a compiled region: the forward graph's outputs that its backward graph takes
as inputs (every backward placeholder but the ``tangents_*``), which AOTAutograd places at the
end of the forward's outputs (torch/_functorch/partitioners.py: ``_extract_fwd_bwd_outputs``
and ``_extract_graph_with_inputs_outputs``: ``fwd_outputs + saved_values + saved_sym_nodes``).
``GraphCapture.saved_bytes`` counts the unique storages of the saved values of every region
call in the model's last forward, less the regions' parameters and buffers (their
``static_input_idxs``), the model's inputs and its outputs: the same quantity ``measure``'s
``saved_bytes`` reads from the allocator. A region's input saved by it (an activation from
the region before a graph break) counts.

Use (``measure`` runs its copy with this backend instead of Inductor)::

    with captured_graphs() as capture:
        measure(model, inputs, compile=True)
    capture.saved_bytes()
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .compiled import output_tensors

__all__ = ["BACKEND", "GraphCapture", "Region", "captured_graphs", "graph_running"]

# The backend ``compiled.compiled_forward`` gives torch.compile ("inductor" outside
# ``captured_graphs``).
BACKEND: contextvars.ContextVar[Any] = contextvars.ContextVar("vram_widget_backend")

# True while a partitioned graph runs (``_EagerGraph.__call__``)
_RUNNING: contextvars.ContextVar[bool] = contextvars.ContextVar("vram_widget_graph", default=False)


def graph_running() -> bool:
    """Whether a compiled region's graph is running (its ops, not the autograd engine's)."""
    return _RUNNING.get()


@dataclasses.dataclass
class Region:
    """One compiled region's partitioned graphs. One region's graphs may serve several
    calls in one forward (repeated blocks whose guards pass share the compiled code)."""

    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule | None = None
    inference: bool = False
    # the forward's inputs that are parameters and buffers (Inductor's static_input_idxs)
    static_inputs: tuple[int, ...] = ()

    @property
    def saved_count(self) -> int:
        if self.backward is None:
            return 0
        return sum(
            1
            for n in self.backward.graph.nodes
            if n.op == "placeholder" and not n.name.startswith("tangents")
        )


@dataclasses.dataclass(frozen=True)
class _Call:
    """One call of a region's forward graph: each output's storage and bytes, and the
    storages of its inputs that are parameters and buffers."""

    region: Region
    outputs: tuple[tuple[Any, int], ...]
    statics: frozenset[Any]

    def saved(self) -> dict[Any, int]:
        """The saved values' storages and their bytes, less the parameters' and buffers'."""
        count = self.region.saved_count
        if not count:
            return {}
        return {
            key: nbytes
            for key, nbytes in self.outputs[-count:]
            if key is not None and key not in self.statics
        }


class _EagerGraph:
    """A partitioned graph as Inductor's ``OutputCode`` is called: boxed (the inputs list is
    taken over and cleared), run node by node by ``torch.fx.Interpreter``."""

    def __init__(self, gm: torch.fx.GraphModule, region: Region | None, calls: list[_Call]) -> None:
        # an instance attribute, as Inductor's OutputCode sets it: the torch._dynamo.disable
        # wrapper AOTAutograd puts around a backward copies the instance's __dict__
        # (functools.wraps), and call_func_at_runtime_with_args reads it there
        self._boxed_call = True
        self.gm = gm
        self.region = region  # a forward's region, to note each call in ``calls``
        self.calls = calls

    def __call__(self, *args: Any) -> Any:
        # boxed (one list) as AOTAutograd calls a forward; unboxed where it wraps the
        # backward in ``torch._dynamo.disable`` (which drops ``_boxed_call``)
        inputs = args[0] if len(args) == 1 and isinstance(args[0], list) else list(args)
        del args
        region = self.region
        statics: frozenset[Any] = frozenset()
        if region is not None:
            statics = frozenset(
                _storage(inputs[i])[0] for i in region.static_inputs if i < len(inputs)
            )
        token = _RUNNING.set(True)
        try:
            out = self._run(inputs)
        finally:
            _RUNNING.reset(token)
        if region is not None and not region.inference:
            self.calls.append(_Call(region, tuple(_storage(t) for t in out), statics))
        return out

    def _run(self, inputs: list[Any]) -> Any:
        return torch.fx.Interpreter(self.gm, garbage_collect_values=True).boxed_run(inputs)

    # the rest of Inductor's OutputCode protocol (torch/_inductor/output_code.py)
    def post_compile(self, *_args: Any, **_kwargs: Any) -> None:
        return None

    def prepare_for_serialization(self) -> None:
        return None

    def set_triton_bundle(self, _bundle: Any) -> None:
        return None


class _GeneratedGraph(_EagerGraph):
    """A partitioned graph run as Inductor's generated code on fake tensors
    (``compiled_inductor.inductor_graph``), boxed as ``_EagerGraph``. Where its first call
    (the unrecorded warm-up's) raises, the graph runs node by node from then on, and
    ``failures`` gets the reason."""

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        region: Region | None,
        calls: list[_Call],
        generated: Any,
        failures: list[str],
    ) -> None:
        super().__init__(gm, region, calls)
        self.generated: Any = generated
        self.failures = failures
        self.proven = False

    def _run(self, inputs: list[Any]) -> Any:
        if self.generated is None:
            return super()._run(inputs)
        if self.proven:
            return self.generated(inputs)
        kept = list(inputs)  # the generated code clears the list it is given
        try:
            out = self.generated(inputs)
        except Exception as exc:  # any failure: the graph node by node
            self.failures.append(_reason("running", exc))
            self.generated = None
            return super()._run(kept)
        self.proven = True
        return out


def _reason(stage: str, exc: BaseException) -> str:
    """One line: why a graph runs node by node instead of as Inductor's code."""
    head = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{stage} Inductor's code: {type(exc).__name__}: {head}"[:300]


def _storage(t: Any) -> tuple[Any, int]:
    """A tensor's storage key (``StorageWeakRef``, which fake tensors have too) and bytes."""
    if not isinstance(t, torch.Tensor) or t.layout is not torch.strided:
        return None, 0
    storage = t.untyped_storage()
    return StorageWeakRef(storage), int(storage.nbytes())


class GraphCapture:
    """A ``torch.compile`` backend: Inductor's passes and partition, the graphs run eagerly
    (module docstring). ``regions`` in the order their forwards were compiled."""

    def __init__(self, generated: bool = False, fallbacks: list[str] | None = None) -> None:
        # True: each graph runs as Inductor's generated code (compiled_inductor.py) where
        # it can, else node by node; ``fallbacks`` says why a graph runs node by node
        self.generated = generated
        self.fallbacks: list[str] = [] if fallbacks is None else fallbacks
        self.regions: list[Region] = []
        # forwards whose backward is not compiled yet, by dynamo's compile id
        self._pending: dict[str, Region] = {}
        # the training forward graphs' calls since the model's last forward call ended,
        # and those of that call (with the storages of its inputs and outputs), which
        # compiled.WatchedForward tells
        self._calls: list[_Call] = []
        self.forward_calls: list[_Call] = []
        self.model_inputs: set[Any] = set()
        self.model_outputs: set[Any] = set()
        self.model_output_bytes: dict[Any, int] = {}
        # the storages the eager autograd nodes of the last forward save (the code between
        # compiled regions: compile="blocks", graph breaks)
        self.eager_saved: set[Any] = set()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        from torch._functorch import config as functorch_config
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx

        # _EagerGraph follows OutputCode's protocol without subclassing it
        inner: Any = self._inner
        # AOTAutograd's and Inductor's caches off: a hit would skip inner_compile
        with (
            functorch_config.patch(enable_autograd_cache=False),
            inductor_config.patch(fx_graph_cache=False),
        ):
            return compile_fx(gm, example_inputs, inner_compile=inner)

    def _inner(
        self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any
    ) -> _EagerGraph:
        # A region's backward is compiled at its first backward call (regions in reverse
        # order), under the compile context its forward was compiled in
        # (torch/_functorch/_aot_autograd/runtime_wrappers.py: the lazy backward runs in
        # ``compile_context(saved_compile_context)``): its compile id pairs them.
        compile_id = str(torch._guards.CompileContext.current_compile_id())
        region = None
        if kwargs.get("is_backward"):
            self._pending.pop(compile_id).backward = gm
        else:
            region = Region(
                forward=gm,
                inference=bool(kwargs.get("is_inference")),
                static_inputs=tuple(kwargs.get("static_input_idxs") or ()),
            )
            self.regions.append(region)
            if not region.inference:
                self._pending[compile_id] = region
        if not self.generated:
            return _EagerGraph(gm, region, self._calls)
        from .compiled_inductor import inductor_graph

        generated = None
        try:  # Inductor lowers a copy: the graph itself stays for the node-by-node run
            generated = inductor_graph(copy_graph(gm), example_inputs, **kwargs)
        except Exception as exc:  # any failure: the graph node by node
            self.fallbacks.append(_reason("compiling", exc))
        return _GeneratedGraph(gm, region, self._calls, generated, self.fallbacks)

    def saved_bytes(self) -> int:
        """The saved set's bytes over every region call of the model's last forward (module
        docstring)."""
        unique: dict[Any, int] = {}
        for call in self.forward_calls:
            unique.update(call.saved())
        excluded = self.model_inputs | self.model_outputs
        return sum(nbytes for key, nbytes in unique.items() if key not in excluded)

    def note_forward(self, args: Any, out: Any) -> None:
        """The model's forward call has ended: its region calls, and its inputs' and
        outputs' storages."""
        self.forward_calls, self._calls[:] = list(self._calls), []
        self.model_inputs = {key for key, _ in map(_storage, output_tensors(args))}
        self.model_output_bytes = dict(map(_storage, output_tensors(out)))
        self.model_output_bytes.pop(None, None)
        self.model_outputs = set(self.model_output_bytes)
        self.eager_saved = _eager_saved(output_tensors(out))


def _eager_saved(outputs: list[torch.Tensor]) -> set[Any]:
    """The storages saved by the autograd nodes reachable from ``outputs`` that expose
    them (eager ATen ops' ``_saved_*`` attributes; a compiled region's node keeps its own,
    which the partitioner's saved set holds)."""
    found: set[Any] = set()
    seen: set[Any] = set()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for name in dir(node):
            if name.startswith("_saved_"):
                try:
                    value = getattr(node, name)
                except RuntimeError:  # freed already, or not unpackable
                    continue
                for t in value if isinstance(value, (tuple, list)) else (value,):
                    key, _ = _storage(t)
                    if key is not None:
                        found.add(key)
        stack.extend(fn for fn, _ in node.next_functions if fn is not None)
    return found


def copy_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` that shares its attributes (Inductor's passes rewrite the graph
    they lower in place)."""
    import copy

    # Graph.__deepcopy__ copies the nodes and their meta (graph_copy), the output's too
    out = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    out.meta.update(gm.meta)
    return out


@contextlib.contextmanager
def captured_graphs(
    generated: bool = False, fallbacks: list[str] | None = None
) -> Iterator[GraphCapture]:
    """``measure(compile=...)`` inside runs its copy with a ``GraphCapture`` backend
    (``generated``, ``fallbacks``: ``GraphCapture``'s)."""
    capture = GraphCapture(generated, fallbacks)
    token = BACKEND.set(capture)
    try:
        yield capture
    finally:
        BACKEND.reset(token)
