"""Activation offloading on the torch side: the ``offload_activations`` lever
(``_estimating/offloading.py``) applied around the model's forward.

For ``measure`` the real hooks run: torchtune's ``OffloadActivations`` (loaded from its own
file, :func:`torchtune_offloading`) with its ``NoOpManager`` on the output projection, as
``get_act_offloading_ctx_manager`` puts them (torchtune 0.6.1,
``training/_activation_offloading.py``), or torch's ``save_on_cpu()``.

For the estimate, :class:`OffloadEmulation` runs the same pack / unpack decisions on the
profile's tensors. A ``device="cuda"`` profile runs on fake CPU tensors that stand for CUDA
ones (CUDA_SEMANTICS.md: on a CPU-only torch a fake CUDA tensor that requires grad aborts the
process), so ``.to("cpu")`` there copies nothing, and torchtune's class cannot be built
(its ``__init__`` asks ``torch.cuda.default_stream()``). The emulation makes what the real
hooks do visible to the recorder:

* the host copy is made with the recorder paused (it is no device memory) and counted in
  the host bytes (``host_peak_bytes``);
* once packed, autograd holds the copy, not the device tensor, which dies when the forward
  lets go of it (torchtune's ``fwd_stash`` keeps the last ones alive, below);
* in the backward, the copy brought back (``.to("cuda")``) is a new device tensor, recorded
  as the unpack hook allocates it.

torchtune's streams (``use_streams=True``, its default) order the copies on a second CUDA
stream; their events change no byte count, and their memory effect is which tensors stay
referenced, emulated line by line from ``pack_tensor`` / ``unpack_tensor_with_streams``:
``fwd_stash`` keeps each offloaded activation alive until ``max_fwd_stash_size`` (5) later
saved tensors were packed, and until the first backward node that unpacks ends; tensors
still in it are handed back as they are (no copy); ``bwd_tensor_stash`` keeps each tensor
brought back alive until the next node that brings one back has run (or, where the node's
outputs took a view of it, ``record_stream`` until the compute stream is done with it:
taken as freed with the node here). When a stream's work is done is timing on the GPU:
UNCONFIRMED until a GPU run (``measure``) checks it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import pathlib
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.autograd.variable import Variable

from .._estimating.offloading import Offload, resolve_offload

__all__ = [
    "OffloadEmulation",
    "offloaded_forward",
    "output_projection",
    "real_offloading",
    "torchtune_offloading",
]

# torchtune 0.6.1, training/_activation_offloading.py, OffloadActivations.__init__ defaults
MIN_OFFLOAD_BYTES = 1024  # min_offload_size
MAX_FWD_STASH = 5  # max_fwd_stash_size
_FILE = ("training", "_activation_offloading.py")


def _offloading_file() -> pathlib.Path | None:
    spec = importlib.util.find_spec("torchtune")  # a top-level find_spec runs no __init__
    if spec is None or not spec.submodule_search_locations:
        return None
    path = pathlib.Path(next(iter(spec.submodule_search_locations))).joinpath(*_FILE)
    return path if path.is_file() else None


@functools.cache
def torchtune_offloading() -> types.ModuleType:
    """torchtune's ``training/_activation_offloading.py``, loaded from its own file.

    ``import torchtune`` fails beside torchao 0.18 (torchtune 0.6.1's ``__init__`` and its
    ``modules`` import ``torchao.dtypes.nf4tensor``, which torchao moved). The file is run
    without the package: for its imports, only what cannot be imported is stubbed in
    ``sys.modules`` while it runs, and removed again: ``torchao.dtypes.nf4tensor.NF4Tensor``
    (used by the file only to word an error about old torchao), ``torchtune.modules.TiedLinear``
    (an ``isinstance`` test of the output head: a class nothing is an instance of) and
    ``torchtune.utils.get_logger`` (a ``logging`` logger).

    Examples
    --------
    >>> torchtune_offloading().OffloadActivations.__name__  # doctest: +SKIP
    'OffloadActivations'
    """
    path = _offloading_file()
    if path is None:
        raise ImportError(
            "offload_activations='torchtune' runs torchtune's own OffloadActivations, and "
            "torchtune is not installed: pip install torchtune"
        )
    stubs: dict[str, types.ModuleType] = {}
    try:
        import torchao.dtypes.nf4tensor  # noqa: F401
    except ImportError:  # moved, or no torchao at all: the packages above it too
        for name in ("torchao", "torchao.dtypes"):
            try:
                importlib.import_module(name)
            except ImportError:
                parent = stubs[name] = types.ModuleType(name)
                parent.__path__ = []
        nf4 = stubs["torchao.dtypes.nf4tensor"] = types.ModuleType("torchao.dtypes.nf4tensor")
        nf4.NF4Tensor = type("NF4Tensor", (torch.Tensor,), {})  # type: ignore[attr-defined]
    try:
        import torchtune.modules
        import torchtune.utils  # noqa: F401
    except ImportError:
        package = stubs["torchtune"] = types.ModuleType("torchtune")
        package.__path__ = []
        modules = stubs["torchtune.modules"] = types.ModuleType("torchtune.modules")
        modules.TiedLinear = type("TiedLinear", (), {})  # type: ignore[attr-defined]
        utils = stubs["torchtune.utils"] = types.ModuleType("torchtune.utils")
        utils.get_logger = lambda level=None: logging.getLogger("torchtune")  # type: ignore[attr-defined]
    saved = {name: sys.modules.get(name) for name in stubs}
    sys.modules.update(stubs)
    try:
        spec = importlib.util.spec_from_file_location("_vram_widget_torchtune_offloading", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    return module


def output_projection(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module torchtune's recipes run under ``NoOpManager``: ``model.output`` (a
    torchtune decoder's; ``TiedLinear`` is no module, and has none here), else a Hugging Face
    model's ``get_output_embeddings()``; None where the model has neither (torchtune then
    warns that the output head, if any, is offloaded)."""
    head = getattr(model, "output", None)
    if isinstance(head, torch.nn.Module):
        return head
    get = getattr(model, "get_output_embeddings", None)
    found = get() if callable(get) else None
    return found if isinstance(found, torch.nn.Module) else None


def _no_op_around(
    module: torch.nn.Module | None, hooks: Callable[[], Any]
) -> contextlib.AbstractContextManager[Any]:
    """``module``'s forward run under the hooks ``hooks()`` makes (a NoOpManager), as
    ``get_act_offloading_ctx_manager`` registers them: a forward pre-hook enters it, a
    forward hook (``always_call=True``) leaves it. Removed when the context ends."""
    stack = contextlib.ExitStack()
    if module is None:
        return stack
    manager = hooks()
    pre = module.register_forward_pre_hook(lambda *_: manager.__enter__())
    post = module.register_forward_hook(lambda *_: manager.__exit__(), always_call=True)
    stack.callback(pre.remove)
    stack.callback(post.remove)
    return stack


def offloaded_forward(
    forward: Callable[..., Any],
    hooks: Callable[[], contextlib.AbstractContextManager[Any]],
) -> Callable[..., Any]:
    """``forward`` run inside a fresh offloading context from ``hooks()`` each call, as
    torchtune's recipes run the model's forward (and only it) inside theirs."""

    def run(*args: Any, **kwargs: Any) -> Any:
        with hooks():
            return forward(*args, **kwargs)

    return run


def real_offloading(
    model: torch.nn.Module, value: object
) -> tuple[Callable[[], contextlib.AbstractContextManager[Any]], contextlib.ExitStack]:
    """The real hooks of ``offload_activations=value`` for ``measure``: a factory of the
    context its forward runs in, and an ExitStack that holds the ``NoOpManager`` hooks on
    the output projection (torchtune) until it is closed.

    torchtune's ``OffloadActivations()`` is one object for the whole loop, as the recipes
    make it once (``get_act_offloading_ctx_manager``); ``save_on_cpu()`` is torch's, with
    its default ``pin_memory=False``."""
    offload = resolve_offload(value)
    stack = contextlib.ExitStack()
    if offload is Offload.SAVE_ON_CPU:
        return torch.autograd.graph.save_on_cpu, stack
    if offload is None:
        return contextlib.nullcontext, stack
    if not torch.cuda.is_available():
        raise ValueError(
            "offload_activations='torchtune' is measured with torchtune's OffloadActivations, "
            "which needs CUDA (it builds torch.cuda streams); measure it on a GPU, or measure "
            "offload_activations='save_on_cpu'"
        )
    module = torchtune_offloading()
    manager = module.OffloadActivations()
    stack.enter_context(_no_op_around(output_projection(model), module.NoOpManager))
    return lambda: manager, stack


class _HostCopy:
    """A saved tensor's copy in host memory: its bytes counted while it lives."""

    __slots__ = ("__weakref__", "device", "nbytes", "owner", "tensor")

    def __init__(self, owner: OffloadEmulation, tensor: torch.Tensor, device: torch.device):
        self.owner, self.tensor, self.device = owner, tensor, device
        self.nbytes = tensor.numel() * tensor.element_size()
        owner._host_add(self.nbytes)

    def __del__(self) -> None:
        self.owner._host_add(-self.nbytes)


class OffloadEmulation:
    """The pack / unpack hooks of ``offload`` on a profile's tensors (module docstring).

    ``mark`` is the recorder's own pack hook (what autograd keeps on the device), called
    for every saved tensor that is not offloaded. ``paused`` a context in which the
    recorder records nothing (the host copies). ``params`` the ids of the step's
    parameters (torchtune does not offload an ``nn.Parameter``). ``plan`` the offload
    decisions of an earlier run of the same step by saved tensor (torchtune's 1024-byte
    threshold decided once, at the first batch size profiled, so that every batch size
    runs the same step and the fit holds; filled by the first run).
    """

    def __init__(
        self,
        offload: Offload,
        mark: Callable[[torch.Tensor], Any],
        paused: Callable[[], contextlib.AbstractContextManager[Any]],
        params: frozenset[int] = frozenset(),
        plan: list[bool] | None = None,
    ) -> None:
        self.offload = offload
        self.mark = mark
        self.paused = paused
        self.params = params
        self.plan = [] if plan is None else plan
        self.host_bytes = 0
        self.host_peak_bytes = 0
        self.packed = 0  # saved tensors packed in this step (torchtune's tensor_id)
        # torchtune's state (OffloadActivations.__init__)
        self.tracker: dict[int, tuple[Any, bool]] = {}
        self.fwd_stash: dict[int, torch.Tensor] = {}
        self.bwd_tensor_stash: dict[int, torch.Tensor] = {}
        self.is_first_forward_call = True
        self.is_first_backward_call = True
        self.curr_graph_id: int | None = None
        self.curr_autograd_node: Any = None
        self.offloaded: list[int] = []  # the tensor ids offloaded, in order (for tests)
        self.brought_back: list[int] = []  # ... and brought back from the host

    def _host_add(self, nbytes: int) -> None:
        self.host_bytes += nbytes
        self.host_peak_bytes = max(self.host_peak_bytes, self.host_bytes)

    def hooks(self) -> contextlib.AbstractContextManager[Any]:
        """The offloading context of one forward."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def no_op(self) -> contextlib.AbstractContextManager[Any]:
        """torchtune's ``NoOpManager``: what it saves stays on the device."""
        return torch.autograd.graph.saved_tensors_hooks(self._keep, _identity)

    def _keep(self, t: torch.Tensor) -> torch.Tensor:
        self.mark(t)
        return t

    def _host_copy(self, t: torch.Tensor) -> _HostCopy:
        with self.paused():  # host memory: no device allocation
            # torch.empty_like(activation, pin_memory=..., device="cpu") then copy_
            copy = torch.empty_like(t).copy_(t.detach())
        return _HostCopy(self, copy, t.device)

    def _device_copy(self, host: _HostCopy) -> torch.Tensor:
        # .to("cuda") of the host copy: a new device tensor of its layout (preserve_format)
        return torch.empty_like(host.tensor).copy_(host.tensor)

    def _decide(self, t: torch.Tensor) -> bool:
        index = self.packed - 1
        if index < len(self.plan):
            return self.plan[index]
        # torchtune: num_bytes >= min_tensor_size_bytes and not a Parameter or Buffer
        chosen = (
            t.numel() * t.element_size() >= MIN_OFFLOAD_BYTES
            and id(t) not in self.params
            and not isinstance(t, torch.nn.Parameter | torch.nn.Buffer)
        )
        self.plan.append(chosen)
        return chosen

    # -- pack / unpack -------------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> Any:
        if self.offload is Offload.SAVE_ON_CPU:
            # torch/autograd/graph.py, save_on_cpu.pack_to_cpu: (tensor.device, tensor.cpu())
            self.packed += 1
            self.offloaded.append(self.packed)
            return self._host_copy(t)
        return self._pack_torchtune(t)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _HostCopy):  # save_on_cpu.unpack_from_cpu: tensor.to(device)
            self.brought_back.append(0)
            return self._device_copy(packed)
        return self._unpack_torchtune(packed)

    def _pack_torchtune(self, activation: torch.Tensor) -> int:
        if self.is_first_forward_call:  # pack_tensor
            self.is_first_forward_call = False
            self.is_first_backward_call = True
        self.packed += 1
        tensor_id = self.packed
        if not self._decide(activation):
            self.mark(activation)
            self.tracker[tensor_id] = (activation, False)
            return tensor_id
        # use_streams: sync back and dereference offloads at least max_fwd_stash_size old
        for old in list(self.fwd_stash):
            if old <= tensor_id - MAX_FWD_STASH:
                del self.fwd_stash[old]
            else:
                break
        self.tracker[tensor_id] = (self._host_copy(activation), True)
        self.fwd_stash[tensor_id] = activation  # kept alive until the copy stream is done
        self.offloaded.append(tensor_id)
        return tensor_id

    def _unpack_torchtune(self, tensor_id: int) -> torch.Tensor:
        if self.is_first_backward_call:  # unpack_tensor_with_streams
            self.curr_graph_id = torch._C._current_graph_task_id()
            # wait_and_del_remaining_references, at the end of the backward
            Variable._execution_engine.queue_callback(self.bwd_tensor_stash.clear)
            self.is_first_backward_call = False
            self.is_first_forward_call = True
        held, modified = self.tracker.pop(tensor_id)
        if not modified:
            result: torch.Tensor = held
            return result
        graph_id = torch._C._current_graph_task_id()
        node = torch._C._current_autograd_node()
        prev_node_ids: list[int] = []
        if graph_id == self.curr_graph_id and self.curr_autograd_node != node:
            self.curr_autograd_node = node
            prev_node_ids = list(self.bwd_tensor_stash)
        brought_back = tensor_id not in self.fwd_stash
        refcount = 0
        if brought_back:
            tensor = self._device_copy(held)
            self.bwd_tensor_stash[tensor_id] = tensor
            self.brought_back.append(tensor_id)
            refcount = _storage_uses(tensor)
        else:
            tensor = self.fwd_stash[tensor_id]
        del held  # the tracker's entry: the host copy is freed

        def hook(outputs: Any, _inputs: Any) -> Any:
            if brought_back and tensor_id in self.bwd_tensor_stash:
                unpacked = self.bwd_tensor_stash[tensor_id]
                if _storage_uses(unpacked) > refcount:
                    # a view of it outlives the node: torchtune calls record_stream and
                    # drops it from the stash; the allocator then frees it once the compute
                    # stream is done with it (UNCONFIRMED: taken as freed with its last
                    # reference here). Else it stays until the next node's hook.
                    del self.bwd_tensor_stash[tensor_id]
                del unpacked
            self.fwd_stash.clear()  # the backward has begun: no forward copy is pending
            for old in prev_node_ids:
                self.bwd_tensor_stash.pop(old, None)
            return outputs

        if node is not None:
            node.register_hook(hook)
        return tensor


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _storage_uses(t: torch.Tensor) -> int:
    """References to ``t``'s storage, as torchtune counts them (``_storage_Use_Count``)."""
    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))


@contextlib.contextmanager
def emulated_offloading(
    model: torch.nn.Module, emulation: OffloadEmulation
) -> Iterator[Callable[[], contextlib.AbstractContextManager[Any]]]:
    """The forward context of ``emulation`` for a profiling run, with torchtune's
    ``NoOpManager`` on ``model``'s output projection while it is open."""
    with contextlib.ExitStack() as stack:
        if emulation.offload is Offload.TORCHTUNE:
            stack.enter_context(_no_op_around(output_projection(model), emulation.no_op))
        yield emulation.hooks
