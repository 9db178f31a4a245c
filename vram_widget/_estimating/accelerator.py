"""What a CUDA device charges beyond the tensors' own bytes (no torch: the estimator imports this).

Each figure carries its source; the fact sheet is ``docs/cuda-semantics.md`` §6.
These are *extras*, shown as separate labelled lines, never folded into tensor bytes
(docs/guides/memory-and-oom.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import ClassVar

import numpy as np

__all__ = [
    "CUBLAS_WORKSPACE_BYTES_DEFAULT",
    "CUBLAS_WORKSPACE_BYTES_SM90",
    "CUDA_BLOCK_BYTES",
    "CUDA_CONTEXT_BYTES",
    "AcceleratorExtras",
    "CudaContext",
    "NcclBuffers",
    "cublas_workspace_bytes",
    "cuda_block_bytes",
    "cuda_context",
    "given_cuda_context",
    "nccl_buffers",
    "nccl_connection_bytes",
]

CUDA_BLOCK_BYTES = 512
"""Allocation granularity of the CUDA caching allocator (``kMinBlockSize``): every block is a
multiple of 512 bytes, at least 512. [src: pytorch/pytorch c10/cuda/CUDACachingAllocator.cpp
· round_size; fact sheet §6.1]"""

CUBLAS_WORKSPACE_BYTES_DEFAULT = 8_519_680
"""cuBLAS workspace per (handle, stream) with the default ``CUBLAS_WORKSPACE_CONFIG=:4096:2:16:8``:
2 x 4096 KiB + 8 x 16 KiB. Allocated through the caching allocator on the first cuBLAS call and
kept, so it counts in ``memory_allocated`` (https://github.com/pytorch/pytorch/issues/95668 shows
``memory_allocated() == 8519680`` after one ``nn.Linear`` on 2.0). [src: pytorch/pytorch
aten/src/ATen/cuda/CublasHandlePool.cpp · parseChosenWorkspaceSize; docs/source/notes/cuda.rst
"cuBLAS workspaces"; fact sheet §6.3]"""

CUBLAS_WORKSPACE_BYTES_SM90 = 32 * 2**20
"""cuBLAS workspace on Hopper (sm90): 32 MiB since pytorch/pytorch PR 89027 (2.0); recent
main also uses it for major 10/11/12 (Blackwell history per release UNCONFIRMED).
[src: CublasHandlePool.cpp · getChosenWorkspaceSize; fact sheet §6.3]"""


@dataclasses.dataclass(frozen=True)
class CudaContext:
    """One figure of the CUDA context's device memory, with where it comes from.

    Attributes
    ----------
    nbytes
        Bytes on the device outside the caching allocator (in neither ``memory_allocated``
        nor ``memory_reserved``).
    source
        Where the figure comes from, and whether it is a measurement or an estimate.
    """

    nbytes: int
    source: str


# The CUDA context (driver state, the kernels loaded so far, library handles) lives outside
# the caching allocator, so it is in neither ``memory_allocated`` nor ``memory_reserved`` but
# uses device memory (fact sheet §6.2). Its size depends on the GPU, the driver, the CUDA
# version, the libraries loaded (cuBLAS, cuDNN, NCCL) and ``CUDA_MODULE_LOADING``:
# - lazy loading loads a kernel on its first use instead of every module's kernels when a
#   library loads; it came in CUDA 11.7 (off by default), is on by default on Linux since
#   CUDA 12.2 and on every platform since 12.3 (NVIDIA CUDA Programming Guide, "Lazy
#   Loading", Table "Select Lazy Loading Changes by CUDA Version"); it needs driver >= 515;
# - PyTorch sets ``CUDA_MODULE_LOADING=LAZY`` where the user has not set it, since 1.13
#   (pytorch/pytorch#86509), so lazy loading is torch's default: the table's default column.
# Each row: (compute capability, lazy loading) -> bytes, its source, measured or estimated.
# A capability of (major, -1) stands for every minor of that major; lookups fall back from
# the exact capability to its major, then to the column's "any GPU" row (0, -1).
_CONTEXT_TABLE: dict[tuple[tuple[int, int], bool], CudaContext] = {
    ((8, 9), True): CudaContext(
        426 * 2**20,
        "measured: 426 MiB in nvidia-smi after torch.cuda.mem_get_info() created the context, "
        "before any kernel ran (RTX 6000 Ada, sm89; torch 2.10.0+cu130, lazy loading; "
        "unslothai/unsloth-zoo#1053)",
    ),
    ((9, -1), True): CudaContext(
        775 * 2**20,
        "measured: 771-775 MiB (cudaMemGetInfo's used memory less memory_reserved()) after "
        "real training and inference steps of ResNet-50, GPT-2 and a 1.2B Llama (H200, sm90; "
        "torch 2.11.0+cu130, driver 580.159.04, lazy loading; "
        "benchmarks/results/accuracy_cuda.json); the largest, once the steps' kernels loaded",
    ),
    ((10, -1), True): CudaContext(
        775 * 2**20,
        "estimate: 775 MiB, the figure measured on Hopper assumed for Blackwell with lazy "
        "loading; UNCONFIRMED",
    ),
    ((0, -1), True): CudaContext(
        400 * 2**20,
        "estimate: 400 MiB, 'around 400MB if CUDA >= 11.7 is used and lazy module loading "
        "enabled' (PyTorch maintainer, pytorch#109888; GPU unstated); UNCONFIRMED for a "
        "given GPU",
    ),
    ((6, 1), False): CudaContext(
        721 * 2**20,
        "measured: 721 MiB in nvidia-smi after torch.Tensor(1).cuda() (GTX 1080, sm61; torch "
        "1.8.2+cu101, eager loading; pytorch#55277)",
    ),
    ((7, 0), False): CudaContext(
        1343 * 2**20,
        "measured: 1,343 MiB in NVML's used memory after torch.ones((1, 1)).to('cuda') "
        "(V100, sm70; eager loading, 2022; Hugging Face Transformers docs, 'Model training "
        "anatomy')",
    ),
    ((8, 6), False): CudaContext(
        1687 * 2**20,
        "measured: 1,687 MiB in nvidia-smi after torch.Tensor(1).cuda() (RTX 3090, sm86; "
        "torch 1.8.2+cu111, eager loading; pytorch#55277)",
    ),
    ((0, -1), False): CudaContext(
        1343 * 2**20,
        "estimate: 1,343 MiB, the V100 measurement (Hugging Face Transformers docs, 'Model "
        "training anatomy') for a GPU without a row of its own with eager loading; "
        "'all kernels ... took >1000MB' before lazy loading (pytorch#107667); UNCONFIRMED",
    ),
}


def cuda_context(compute_capability: tuple[int, int], lazy_loading: bool = True) -> CudaContext:
    """The CUDA context's bytes on a GPU of ``compute_capability``, with their source.

    The table's row for the exact capability, else for its major, else the "any GPU" row
    of the column (lazy or eager module loading; lazy is torch's default since 1.13).

    Parameters
    ----------
    compute_capability : (major, minor)
        The target GPU's (``torch.cuda.get_device_capability()``).
    lazy_loading : bool
        ``CUDA_MODULE_LOADING=LAZY`` (torch's default) or eager (``EAGER``, or a CUDA or
        driver too old for lazy loading: CUDA < 11.7, driver < 515).

    Returns
    -------
    CudaContext

    Examples
    --------
    >>> cuda_context((8, 9)).nbytes // 2**20                        # RTX 6000 Ada, measured
    426
    >>> cuda_context((9, 0)).nbytes // 2**20                        # Hopper, measured
    775
    >>> cuda_context((7, 0), lazy_loading=False).nbytes // 2**20    # V100, eager, measured
    1343
    >>> cuda_context((8, 0)).source.split(":")[0]                   # A100: the any-GPU row
    'estimate'
    """
    major, minor = compute_capability
    for key in ((major, minor), (major, -1), (0, -1)):
        row = _CONTEXT_TABLE.get((key, bool(lazy_loading)))
        if row is not None:
            return row
    raise AssertionError("the table has an any-GPU row in each column")  # pragma: no cover


def given_cuda_context(context_bytes: object) -> CudaContext:
    """The context a caller gives (``context_bytes=``), checked: a whole number of bytes.

    Examples
    --------
    >>> given_cuda_context(600 * 2**20).source
    'given: context_bytes=629145600'
    >>> given_cuda_context(-1)
    Traceback (most recent call last):
    ...
    ValueError: context_bytes must be a whole number of bytes >= 0 (e.g. 600 * 2**20); got -1
    """
    if isinstance(context_bytes, bool) or not isinstance(context_bytes, (int, np.integer)):
        raise ValueError(
            "context_bytes must be a whole number of bytes >= 0 (e.g. 600 * 2**20) or None "
            f"(the table's figure for the GPU); got {context_bytes!r}"
        )
    if context_bytes < 0:
        raise ValueError(
            f"context_bytes must be a whole number of bytes >= 0 (e.g. 600 * 2**20); got "
            f"{context_bytes!r}"
        )
    return CudaContext(int(context_bytes), f"given: context_bytes={int(context_bytes)}")


CUDA_CONTEXT_BYTES = cuda_context((9, 0)).nbytes
"""The CUDA context of the default GPU (an H100, lazy loading): 775 MiB, measured on a
Hopper GPU after real steps (:func:`cuda_context` has the table and its sources). Measure
on the target:
``torch.cuda.mem_get_info()`` (total - free) minus ``torch.cuda.memory_reserved()`` after
the first kernels have run, and give it as ``context_bytes=``."""

_INT64_MAX = np.iinfo(np.int64).max


def cuda_block_bytes(nbytes: np.ndarray) -> np.ndarray:
    """The CUDA caching allocator's charge for each request of ``nbytes`` bytes.

    ``0`` for a 0-byte request (no block is allocated), otherwise ``nbytes`` rounded up to a
    multiple of 512, at least 512 [src: c10/cuda/CUDACachingAllocator.cpp · round_size;
    fact sheet §6.1]. Power-of-two rounding (``roundup_power2_divisions``) and the up-to-1 MiB
    charge of an unsplit large block are not modelled.

    Parameters
    ----------
    nbytes
        Request sizes (any integer array or scalar, non-negative, up to 2**62).

    Returns
    -------
    numpy.ndarray
        int64 array of the same shape.
    """
    n = np.asarray(nbytes, dtype=np.int64)
    if n.size and (n.min() < 0 or n.max() > _INT64_MAX - (CUDA_BLOCK_BYTES - 1)):
        raise ValueError("request sizes must lie in [0, 2**63 - 512]")
    # (n + 511) // 512 * 512 cannot overflow under the bound above; n = 0 stays 0, 1..512 -> 512.
    return (n + (CUDA_BLOCK_BYTES - 1)) // CUDA_BLOCK_BYTES * CUDA_BLOCK_BYTES


def cublas_workspace_bytes(sm: int) -> int:
    """Bytes of one cuBLAS workspace for a GPU of compute capability ``sm`` (``10*major+minor``).

    32 MiB on major 9 (Hopper); 8,519,680 bytes otherwise [src: CublasHandlePool.cpp;
    fact sheet §6.3]. Blackwell (major 10/12) gets 32 MiB on recent main, not in every release
    (UNCONFIRMED per release), so the default is kept for it. In training a second workspace
    appears for the autograd device thread's handle: on an H200 (torch 2.11) a first training
    step allocated 33,554,432 B more after the forward thread's workspace was made. The newest
    releases may not allocate it through the caching allocator at all
    (``TORCH_CUBLAS_WORKSPACE_CACHE``); callers decide how many to count.
    """
    if sm // 10 == 9:
        return CUBLAS_WORKSPACE_BYTES_SM90
    return CUBLAS_WORKSPACE_BYTES_DEFAULT


@dataclasses.dataclass(frozen=True)
class AcceleratorExtras:
    """Device memory beyond the tensors' ``nbytes``, one labelled line each.

    Attributes
    ----------
    allocator_rounding_bytes
        What the CUDA caching allocator's 512-byte blocks add at the peak.
    cublas_workspace_bytes
        cuBLAS workspace(s), counted in ``memory_allocated``: one per thread that runs a
        matmul, so two in training (the forward's and autograd's device thread's).
    cuda_context_bytes
        The CUDA context: outside ``memory_allocated`` and ``memory_reserved``, but on the device.
    cuda_context_source
        Where ``cuda_context_bytes`` comes from: a row of :func:`cuda_context`'s table
        (measured or estimated) or ``context_bytes=`` given.
    cublas_workspace_count
        How many workspaces ``cublas_workspace_bytes`` holds (each its own allocation).
    """

    allocator_rounding_bytes: int
    cublas_workspace_bytes: int
    cuda_context_bytes: int
    cuda_context_source: str = ""
    cublas_workspace_count: int = 0

    source: ClassVar[Mapping[str, str]] = MappingProxyType(
        {
            "allocator_rounding_bytes": (
                "CUDA caching allocator rounds every block up to a multiple of 512 bytes "
                "(c10/cuda/CUDACachingAllocator.cpp · round_size)"
            ),
            "cublas_workspace_bytes": (
                "cuBLAS workspace per handle and stream: 8,519,680 bytes (:4096:2:16:8), 32 MiB on "
                "sm90 (aten/src/ATen/cuda/CublasHandlePool.cpp; pytorch#95668); handles are "
                "per thread and autograd runs a CUDA backward on a device thread of its own, "
                "so a training step has two (measured on an H200, torch 2.11)"
            ),
            "cublas_workspace_count": "the workspaces in cublas_workspace_bytes",
            "cuda_context_bytes": (
                "CUDA context, outside the allocator: a table by compute capability and "
                "CUDA_MODULE_LOADING (accelerator.cuda_context; measured rows from "
                "pytorch#55277, unsloth-zoo#1053 and the Transformers docs, the others "
                "UNCONFIRMED estimates), or context_bytes= given; the estimate's "
                "cuda_context_source says which"
            ),
            "cuda_context_source": (
                "the row of accelerator.cuda_context's table used (its source, measured or "
                "estimated), or 'given: context_bytes=...'"
            ),
        }
    )
    """Where each field's figure comes from (a class attribute, not a dataclass field)."""

    @property
    def total_bytes(self) -> int:
        """The sum of the three byte lines."""
        return self.allocator_rounding_bytes + self.cublas_workspace_bytes + self.cuda_context_bytes


# --- NCCL's own buffers: device memory NCCL allocates itself, outside the caching allocator,
# per communicator (NVIDIA/nccl v2.30.7, commit 5067397c2676d5aed50042fc39e5c8ee96eb0027) ---

NCCL_SIMPLE_BUFFER_BYTES = 4 * 2**20
"""``NCCL_BUFFSIZE``'s default, the SIMPLE protocol's buffer of one connection: "The default
is 4194304 (4 MiB)" [src: NCCL docs, Environment Variables, NCCL_BUFFSIZE; src/init.cc ·
DEFAULT_BUFFSIZE (1 << 22)]"""

NCCL_LL_BUFFER_BYTES = 8 * 512 * 8 * 16
"""The LL protocol's buffer of one connection, 524,288 bytes: NCCL_LL_LINES_PER_THREAD (8) x
NCCL_LL_MAX_NTHREADS (512) x NCCL_STEPS (8) x sizeof(ncclLLFifoLine) (16) [src: src/init.cc ·
DEFAULT_LL_BUFFSIZE; src/include/device.h]"""

NCCL_LL128_BUFFER_BYTES = 120 * 640 * 8 * 8
"""The LL128 protocol's buffer of one connection, 4,915,200 bytes: NCCL_LL128_ELEMS_PER_THREAD
(120) x NCCL_LL128_MAX_NTHREADS (640) x NCCL_STEPS (8) x 8 [src: src/init.cc ·
DEFAULT_LL128_BUFFSIZE; src/include/device.h]"""

NCCL_IPC_ALIGN_BYTES = 2 * 2**20
"""A P2P connection's buffers (every protocol's) are allocated together, rounded up to
CUDA_IPC_MIN, 2 MiB [src: src/transport/p2p.cc · ALIGN_SIZE(recvSize, CUDA_IPC_MIN);
src/include/comm.h]: 10 MiB per connection at the defaults, the 10,485,760-byte
allocations NVIDIA/nccl#1685 logs on 8 x H100."""

NCCL_CHANNELS = 16
"""Channels of a communicator: NCCL picks them by topology search (up to MAXCHANNELS = 64,
src/include/device.h); 16 is what NCCL's logs show on one 8-GPU H800 node
(NVIDIA/nccl#892: 16 coll channels) and NVLS's SM90 default (src/transport/nvls.cc ·
NVLS_NCHANNELS_SM90). UNCONFIRMED for any given machine."""

NCCL_RING_CONNECTIONS = 2
"""Connections per channel of the ring algorithm: "Ring uses a limited amount of memory as it
only has 2 connections regardless of the scale" (NCCL maintainer, NVIDIA/nccl#864, quoted in
#986)."""

NCCL_NVLS_CHUNK_BYTES = 128 * 1024
"""NVLink SHARP's chunk since NCCL 2.21 ("Reduce NVLS memory usage ... 128K", v2.21.5-1
release notes; src/transport/nvls.cc): its buffer per channel is the chunk x NCCL_STEPS (8),
twice (the unicast and multicast sides), for each GPU of the node (nvlsPerRankSize x
nHeads); NCCL_NVLS_ENABLE defaults to 2, on where the hardware has it (H100/H200 with
NVSwitch). Before 2.21 it was 6x larger (vllm-project/vllm#9699 logs 2.25 GiB on H200)."""


@dataclasses.dataclass(frozen=True)
class NcclBuffers:
    """NCCL's own device memory on one rank, outside the caching allocator: never part of
    ``peak_bytes`` or ``total_bytes`` (it does not go through ``memory_allocated``), shown
    beside them with the configuration it assumes.

    Attributes
    ----------
    nbytes
        The total on one GPU.
    communicators
        NCCL communicators on the rank (one per process group that communicates: the
        data-parallel group; HSDP's shard and replicate groups are two).
    ring_bytes
        Per communicator: ``channels x 2 connections x`` one connection's buffers.
    nvls_bytes
        NVLink SHARP's buffers, where assumed on (compute capability 9.0+, an NVSwitch node).
    """

    nbytes: int
    communicators: int
    ring_bytes: int
    nvls_bytes: int

    def describe(self) -> str:
        return (
            f"{self.communicators} NCCL communicator(s) x {NCCL_CHANNELS} channels x "
            f"{NCCL_RING_CONNECTIONS} ring connections x "
            f"{nccl_connection_bytes() // 2**20} MiB (NCCL_BUFFSIZE 4 MiB + LL + LL128)"
            + (f" + {self.nvls_bytes // 2**20} MiB NVLink SHARP" if self.nvls_bytes else "")
            + "; NCCL's defaults, UNCONFIRMED on a given machine (NCCL_BUFFSIZE, "
            "NCCL_MAX_CTAS, NCCL_NVLS_ENABLE change it)"
        )


def nccl_connection_bytes() -> int:
    """One connection's buffers at NCCL's defaults: the three protocols', rounded up to 2 MiB.

    Examples
    --------
    >>> nccl_connection_bytes() == 10 * 2**20   # 4 MiB + 512 KiB + 4.6875 MiB -> 10 MiB
    True
    """
    raw = NCCL_SIMPLE_BUFFER_BYTES + NCCL_LL_BUFFER_BYTES + NCCL_LL128_BUFFER_BYTES
    return -(-raw // NCCL_IPC_ALIGN_BYTES) * NCCL_IPC_ALIGN_BYTES


def nccl_buffers(
    communicators: int, gpus_in_node: int, compute_capability: tuple[int, int]
) -> NcclBuffers:
    """NCCL's buffers on one rank with ``communicators`` communicators, at NCCL's defaults.

    Examples
    --------
    >>> b = nccl_buffers(1, 8, (9, 0))      # one communicator on an 8 x H100 node
    >>> b.ring_bytes // 2**20, b.nvls_bytes // 2**20   # 16 x 2 x 10 MiB; 16 x 2 x 1 MiB x 8
    (320, 256)
    >>> nccl_buffers(2, 8, (8, 0)).nbytes // 2**20     # two communicators on A100s: no NVLS
    640
    """
    ring = NCCL_CHANNELS * NCCL_RING_CONNECTIONS * nccl_connection_bytes()
    nvls = 0
    if compute_capability >= (9, 0) and gpus_in_node > 1:
        nvls = NCCL_CHANNELS * 2 * NCCL_NVLS_CHUNK_BYTES * 8 * gpus_in_node
    return NcclBuffers(communicators * ring + nvls, communicators, ring, nvls)
