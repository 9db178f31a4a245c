"""Real torch.distributed runs for ``measure(..., gpus=N, strategy=...)``.

Each rank is a process forked from the caller (so the model needs no pickling), joined to a
gloo process group on 127.0.0.1 at a free port. A rank that fails sends its own error back;
then, or when the time is up, every rank still running is stopped by its PID, and the error
is raised here. Nothing is left running either way.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import signal
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from .._estimating.levers import repeated_blocks
from .._estimating.options import (
    OPTIMIZER_PACKAGES,
    OptimizerChoice,
    OptimizerImplementation,
    OptimizerName,
    Precision,
    Strategy,
)
from .._estimating.sharding import Parallel, resolve_fsdp_units

__all__ = [
    "SETUPS",
    "DistributedError",
    "RankSetup",
    "free_port",
    "run_ranks",
    "wrapper_bytes",
]

_T = TypeVar("_T")


class DistributedError(RuntimeError):
    """A rank of a distributed measurement failed, or the ranks ran out of time."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(
    fn: Callable[[int, int], Any],
    rank: int,
    world_size: int,
    port: int,
    timeout_s: float,
    queue: Any,
) -> None:
    """A forked rank: join the group, run ``fn(rank, world_size)``, report, exit at once
    (``os._exit``: no atexit handler of the parent runs twice)."""
    import torch.distributed as dist

    # The caller's OpenMP thread pool does not survive the fork: a parallel region in the
    # child would wait on threads that do not exist (GNU libgomp is not fork-safe), so each
    # rank computes on one thread, as DataLoader workers do (torch/utils/data/_utils/
    # worker.py, _worker_loop: torch.set_num_threads(1)).
    torch.set_num_threads(1)
    _fresh_compile_pool()
    _one_gloo_worker()
    _collectives_release_on_caller()
    code = 0
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        try:
            queue.put((rank, True, fn(rank, world_size)))
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # the rank's own error, whatever it is, goes back
        queue.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        code = 1
    finally:
        os._exit(code)


def _fresh_compile_pool() -> None:
    """Forget Inductor's compile thread pool made before the fork: its threads do not
    exist in the child, so a compile in the rank would wait forever on a future none of
    them runs. torch's own at-fork hook resets the process pool only
    (torch/_inductor/async_compile.py, ``after_fork``: ``process_pool.cache_clear()``;
    ``AsyncCompile.pool`` is an ``lru_cache`` too, left as it was), so a parent that
    compiled before (Inductor's C++ kernels on a thread pool) hung its ranks'
    ``compile="blocks"``."""
    import sys

    module = sys.modules.get("torch._inductor.async_compile")
    if module is not None:  # not imported: no pool was made
        module.AsyncCompile.pool.cache_clear()


def _collectives_release_on_caller() -> None:
    """Make this rank's collectives drop their buffers on the calling thread.

    A collective's ``Work`` holds its tensors (and gloo's staging copies: a reduce-scatter
    allreduces a clone of its whole input, ``ProcessGroupGloo::reduce_scatter_tensor_coalesced``
    in torch/csrc/distributed/c10d/ProcessGroupGloo.cpp), and the gloo worker thread that
    ran it holds the ``Work`` until it has finished its loop turn (``runLoop``: the work is
    marked complete, then ``workInProgress_[workerIndex].reset()``). Where the caller lets
    go first, the worker frees the buffers, and the profiler, which records the calling
    thread, never sees the free: the rest of the step reads a buffer more, at random.

    So the group runs one worker thread (:func:`_one_gloo_worker`), and after each
    collective the caller waits for a fence queued behind it (:func:`_fence`): once the
    fence is done, the one worker has finished the collective's turn and dropped it, and
    the caller's own reference is the last. Blocking FSDP2 calls drop theirs at once; a
    functional collective's (DTensor's) is dropped where ``wait_tensor`` unregisters it,
    at the first use of its result, as without this."""
    import inspect

    import torch.distributed as dist

    def blocking(collective: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(collective)

        def call(*args: Any, async_op: bool = False, **kwargs: Any) -> Any:
            args, kwargs = _bytes_of_float8((args, kwargs))
            work = collective(*args, async_op=True, **kwargs)
            if async_op:
                return work
            work.wait()
            _fence(signature.bind_partial(*args, **kwargs).arguments.get("group"))
            del work
            return None

        return call

    _FENCE_ALL_REDUCE.append(dist.all_reduce)
    # FSDP2's (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py) and those a
    # tensor-parallel plan calls itself (transformers' rowwise layers: dist.all_reduce)
    for name in (
        "all_gather_single", "reduce_scatter_single", "all_reduce", "all_gather_into_tensor",
        "reduce_scatter_tensor", "broadcast",
    ):  # fmt: skip
        if hasattr(dist, name):
            setattr(dist, name, blocking(getattr(dist, name)))
    namespace = torch.ops._c10d_functional
    for name in _FUNCTIONAL_COLLECTIVES:
        if hasattr(namespace, name):
            setattr(namespace, name, _SettledCollective(getattr(namespace, name)))


_FLOAT8_DTYPES = tuple(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, name)
)


def _bytes_of_float8(tree: _T) -> _T:
    """``tree`` with each float8 tensor replaced by its bytes (a ``uint8`` view: no copy).

    gloo has no float8 type: its collectives switch on the dtype and raise "Invalid scalar
    type" for any other (``GENERATE_ALL_TYPES`` in torch/csrc/distributed/c10d/
    ProcessGroupGloo.cpp). FSDP2 all-gathers in float8 where every all-gather input of a
    unit is float8 (torchao's ``fsdp_pre_all_gather``; mixed with another dtype, FSDP2
    itself gathers ``uint8`` views: ``foreach_all_gather`` and
    ``_get_all_gather_input_metadatas`` in torch/distributed/fsdp/_fully_shard/
    _fsdp_collectives.py), so float8 reaches gloo there; moving the same bytes as
    ``uint8`` is what NCCL does with them where it has no float8 type (the ``ncclDataType``
    map, torch/csrc/distributed/c10d/NCCLUtils.hpp: ``{at::kFloat8_e4m3fn, ncclUint8}``
    without ``NCCL_SUPPORTS_FP8``); the same bytes either way, and the view allocates
    nothing."""
    from torch.utils._pytree import tree_map_only

    def as_bytes(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.uint8) if t.dtype in _FLOAT8_DTYPES else t

    return tree_map_only(torch.Tensor, as_bytes, tree)


# torch.distributed._functional_collectives' ops (torch.ops._c10d_functional), each
# taking its group's name as its last argument
_FUNCTIONAL_COLLECTIVES = (
    "all_gather_into_tensor",
    "all_gather_into_tensor_coalesced",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all_single",
    "broadcast",
    "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced",
)


class _SettledCollective:
    """A functional collective's op that returns once gloo's worker has let go of its
    ``Work`` (a fence queued behind it is done); its result is waited as before."""

    def __init__(self, packet: Any) -> None:
        self._packet = packet

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from torch._C._distributed_c10d import _resolve_process_group

        out = self._packet(*args, **kwargs)
        _fence(_resolve_process_group(kwargs.get("group_name", args[-1])))
        return out

    def __getattr__(self, name: str) -> Any:  # .default and the packet's other overloads
        return getattr(self._packet, name)


_FENCES: dict[int, torch.Tensor] = {}
# torch.distributed.all_reduce as it was before _collectives_release_on_caller wrapped it
_FENCE_ALL_REDUCE: list[Callable[..., Any]] = []


def _fence(group: Any) -> None:
    """A blocking all-reduce of one byte on ``group`` (None: the default group), queued
    behind the collectives before it; the byte is allocated once per group, before any
    measured step (``dist.barrier`` on gloo allocates and frees one byte at every call,
    measured here: an event inside the step)."""
    key = id(group)
    if key not in _FENCES:
        _FENCES[key] = torch.zeros(1, dtype=torch.uint8)
    _FENCE_ALL_REDUCE[0](_FENCES[key], group=group)


def _one_gloo_worker() -> None:
    """Build this rank's gloo groups with one worker thread (the default is 2:
    ``ProcessGroupGloo._Options()._threads`` in torch 2.13): its collectives then finish,
    and are dropped by the worker, in the order they were queued, which
    :func:`_collectives_release_on_caller` relies on."""
    import torch.distributed.distributed_c10d as c10d

    gloo = c10d.ProcessGroupGloo

    class OneWorker(gloo):  # type: ignore[misc, valid-type]
        def __init__(self, store: Any, rank: int, size: int, timeout: Any = None) -> None:
            options = gloo._Options()  # type: ignore[attr-defined]
            if timeout is not None:
                options._timeout = timeout
            options._devices = [gloo.create_default_device()]
            options._threads = 1
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = OneWorker  # type: ignore[misc]


def run_ranks(fn: Callable[[int, int], _T], world_size: int, timeout_s: float = 600.0) -> list[_T]:
    """``fn(rank, world_size)`` on ``world_size`` forked processes in one gloo group; the
    results in rank order.

    Raises
    ------
    DistributedError
        With the first failing rank's own error and traceback, or when the ranks have not
        all answered within ``timeout_s``; every rank still running is killed by its PID.
    """
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if dist.is_available() and dist.is_initialized():
        raise DistributedError(
            "measure(gpus=N) starts a process group of its own on forked processes; this "
            "process is already in one: call it from a process outside torch.distributed"
        )
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main, args=(fn, rank, world_size, port, timeout_s, queue), daemon=True
        )
        for rank in range(world_size)
    ]
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.start()
        while len(results) < world_size:
            if not queue.empty():
                rank, ok, value = queue.get()
                if not ok:
                    raise DistributedError(f"rank {rank} of {world_size} failed: {value}")
                results[rank] = value
                continue
            dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead and queue.empty():
                raise DistributedError(
                    f"rank {dead[0]} of {world_size} died (exit code "
                    f"{procs[dead[0]].exitcode}) without reporting"
                )
            if time.monotonic() > deadline:
                raise DistributedError(
                    f"the {world_size} ranks did not all finish within {timeout_s:g} s "
                    f"(finished: {sorted(results)})"
                )
            time.sleep(0.01)
    finally:
        for p in procs:
            if p.pid is not None and p.is_alive():
                os.kill(p.pid, signal.SIGKILL)  # by PID, never by name
        for p in procs:
            p.join(timeout=30)
    return [results[r] for r in range(world_size)]


def ddp_wrapped(
    model: torch.nn.Module, _parallel: Parallel, _precision: Precision
) -> torch.nn.Module:
    """``DistributedDataParallel(model)`` with its defaults (the ``"ddp"`` strategy)."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)


def wrapper_bytes(model: torch.nn.Module) -> int:
    """The bytes a data-parallel wrapper holds beside the model's tensors, as the library
    itself reports them: DistributedDataParallel's gradient buckets."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        from .fake import ddp_bucket_sizes

        return sum(ddp_bucket_sizes(model))
    return 0


def fsdp_units_of(model: torch.nn.Module, parallel: Parallel) -> tuple[str, ...]:
    """The modules ``fully_shard`` wraps before the root: ``parallel.fsdp_units`` (names
    or class names; a name of the model before PEFT wrapped it also matches), else each
    child of the largest ``ModuleList`` of repeated blocks (``levers.repeated_blocks``,
    the blocks ``checkpoint="auto"`` takes)."""
    from .step import PEFT_PREFIX

    names, types = zip(*((n, type(m).__name__) for n, m in model.named_modules()), strict=True)
    if parallel.fsdp_units is None:
        return repeated_blocks(names, types)
    known = set(names) | set(types)
    units = [u if u in known else PEFT_PREFIX + u for u in parallel.fsdp_units]
    return resolve_fsdp_units(names, types, units) or ()


def fsdp_wrapped(
    reshard_after_forward: bool,
) -> Callable[[torch.nn.Module, Parallel, Precision], torch.nn.Module]:
    """FSDP2's ``fully_shard`` as torchtitan and accelerate wrap a model: each unit
    (:func:`fsdp_units_of`), then the root, on a CPU mesh of the process group's ranks: 1-D,
    or under ``"hsdp"`` 2-D, (nodes, ``gpus_per_node``), sharded within a node and
    replicated across (``"zero2"``: ``reshard_after_forward=False``; ``"zero3"`` and
    ``"hsdp"``: ``True`` for the units and the library's default for the root, which keeps
    its parameters from forward to backward). Under autocast precisions, with
    ``MixedPrecisionPolicy(param_dtype=<the autocast dtype>, reduce_dtype=torch.float32)``
    (``sharding.FSDP_PARAM_DTYPE``)."""

    def wrap(model: torch.nn.Module, parallel: Parallel, precision: Precision) -> torch.nn.Module:
        mesh = fsdp_mesh(parallel)
        return fully_sharded(model, parallel, precision, mesh, reshard_after_forward)

    return wrap


def fsdp_mesh(parallel: Parallel) -> Any:
    """FSDP2's CPU mesh over the process group's ranks: 1-D, or under ``"hsdp"`` 2-D,
    (nodes, ``gpus_per_node``), sharded within a node and replicated across. Made outside
    any fake mode (a mesh reads its ranks' values)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if parallel.strategy is Strategy.HSDP:
        group = parallel.shard_ranks
        return init_device_mesh(
            "cpu", (world // group, group), mesh_dim_names=("replicate", "shard")
        )
    return init_device_mesh("cpu", (world,))


def fully_sharded(
    model: torch.nn.Module,
    parallel: Parallel,
    precision: Precision,
    mesh: Any,
    reshard_after_forward: bool,
) -> torch.nn.Module:
    """``model`` with FSDP2's ``fully_shard`` on each unit (:func:`fsdp_units_of`), then
    on the root, over ``mesh`` (the data-parallel ranks' mesh; a tensor-parallel model's
    DTensors are sharded on their local tensors): ``reshard_after_forward`` for the
    units, the library's default for the root under zero3, and under autocast precisions
    ``MixedPrecisionPolicy(param_dtype=<the autocast dtype>, reduce_dtype=torch.float32)``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy()
    cast = parallel.param_dtype(precision)
    if cast is not None:
        policy = MixedPrecisionPolicy(param_dtype=getattr(torch, cast), reduce_dtype=torch.float32)
    modules = dict(model.named_modules())
    for name in fsdp_units_of(model, parallel):
        fully_shard(
            modules[name], mesh=mesh, reshard_after_forward=reshard_after_forward,
            mp_policy=policy,
        )  # fmt: skip
    # The root with the library's default under zero3 (None: "for the root, do not
    # reshard after forward", _fsdp_state._lazy_init), as fully_shard(model) gives it.
    root_reshard = None if reshard_after_forward else False
    fully_shard(model, mesh=mesh, reshard_after_forward=root_reshard, mp_policy=policy)
    return model


def zero_optimizer(
    name: OptimizerChoice,
    params: list[torch.Tensor],
    implementation: OptimizerImplementation | None = None,
) -> torch.optim.Optimizer:
    """``ZeroRedundancyOptimizer`` with its defaults around the registered optimizer (the
    ``"zero1"`` strategy): each rank's local optimizer steps its shard of ``params``, run
    as ``implementation`` (as ``step.make_optimizer`` runs it: ``fused=True``,
    ``foreach=True`` / ``False``, or PyTorch's choice for None); ZeroRedundancyOptimizer
    passes the keywords on to each rank's local optimizer
    (torch/distributed/optim/zero_redundancy_optimizer.py, ``_init_local_optimizer``). A
    ``torch.optim`` class only: ZeroRedundancyOptimizer takes an ``optimizer_class``."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from .step import optimizer_spec

    if not isinstance(name, OptimizerName) or name in OPTIMIZER_PACKAGES:
        raise ValueError(
            f"measuring strategy='zero1' with optimizer {name.value!r} is not supported: "
            "ZeroRedundancyOptimizer is measured around a torch.optim optimizer ('sgd', "
            "'sgd-momentum', 'adam', 'adamw', 'adagrad', 'rmsprop')"
        )
    cls, kwargs = optimizer_spec(name)
    if implementation is OptimizerImplementation.FUSED:
        return ZeroRedundancyOptimizer(params, optimizer_class=cls, fused=True, **kwargs)
    foreach = None if implementation is None else implementation is OptimizerImplementation.FOREACH
    return ZeroRedundancyOptimizer(params, optimizer_class=cls, foreach=foreach, **kwargs)


@dataclasses.dataclass(frozen=True)
class RankSetup:
    """How a strategy's libraries set up one rank: the model's wrapper, and the optimizer's
    (None: the registered optimizer over every parameter)."""

    wrap_model: Callable[[torch.nn.Module, Parallel, Precision], torch.nn.Module]
    make_optimizer: (
        Callable[
            [OptimizerChoice, list[torch.Tensor], OptimizerImplementation | None],
            torch.optim.Optimizer,
        ]
        | None
    ) = None
    # the model's experts split over the ranks (expert_parallel.rank_setup), not a tp plan
    expert_parallel: bool = False
    # tensor-parallel ranks of a group (tensor_parallel.rank_setup); the world is dp x tp
    tp: int = 1
    # the wrapper applies PEFT's LoRA itself, after sharding (tensor_parallel.rank_setup)
    applies_lora: bool = False


# strategy -> how its libraries set up a rank (the strategies sharding models)
SETUPS: dict[Strategy, RankSetup] = {
    Strategy.DDP: RankSetup(ddp_wrapped),
    Strategy.ZERO1: RankSetup(ddp_wrapped, zero_optimizer),
    Strategy.ZERO2: RankSetup(fsdp_wrapped(reshard_after_forward=False)),
    Strategy.ZERO3: RankSetup(fsdp_wrapped(reshard_after_forward=True)),
    Strategy.HSDP: RankSetup(fsdp_wrapped(reshard_after_forward=True)),
}
