"""CUDA extras: allocator rounding, cuBLAS workspace, context
(``vram_widget._estimating.accelerator``)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from vram_widget import profile_model, zoo
from vram_widget._estimating.accelerator import (
    CUBLAS_WORKSPACE_BYTES_DEFAULT,
    CUBLAS_WORKSPACE_BYTES_SM90,
    CUDA_CONTEXT_BYTES,
    AcceleratorExtras,
    cublas_workspace_bytes,
    cuda_block_bytes,
    nccl_buffers,
    nccl_connection_bytes,
)


@pytest.mark.parametrize(
    ("request_bytes", "charged"),
    [
        (0, 0),
        (1, 512),
        (511, 512),
        (512, 512),
        (513, 1024),
        (1024, 1024),
        (10**12, 10**12),  # already a multiple of 512
        (10**12 + 1, 10**12 + 512),
        (2**62, 2**62),
        (2**62 + 1, 2**62 + 512),
    ],
)
def test_block_rounding(request_bytes: int, charged: int) -> None:
    out = cuda_block_bytes(np.array([request_bytes]))
    assert out.dtype == np.int64
    assert int(out[0]) == charged


def test_block_rounding_is_vectorized() -> None:
    sizes = np.array([[0, 1, 512], [513, 4096, 100_000]], dtype=np.int64)
    out = cuda_block_bytes(sizes)
    assert out.shape == sizes.shape and out.dtype == np.int64
    assert out.tolist() == [[0, 512, 512], [1024, 4096, 100_352]]
    assert cuda_block_bytes(np.array([], dtype=np.int64)).shape == (0,)
    assert int(cuda_block_bytes(1000)) == 1024  # a scalar works too


def test_block_rounding_rejects_negative_sizes() -> None:
    with pytest.raises(ValueError):
        cuda_block_bytes(np.array([-1]))


def test_cublas_workspace_constants() -> None:
    assert CUBLAS_WORKSPACE_BYTES_DEFAULT == 2 * 4096 * 1024 + 8 * 16 * 1024 == 8_519_680
    assert CUBLAS_WORKSPACE_BYTES_SM90 == 32 * 2**20
    assert cublas_workspace_bytes(90) == CUBLAS_WORKSPACE_BYTES_SM90
    for sm in (70, 75, 80, 86, 89, 100, 120):
        assert cublas_workspace_bytes(sm) == CUBLAS_WORKSPACE_BYTES_DEFAULT


def test_context_is_a_plausible_typical_value() -> None:
    assert 200 * 2**20 <= CUDA_CONTEXT_BYTES <= 2**30


def test_extras_total_and_sources() -> None:
    extras = AcceleratorExtras(
        allocator_rounding_bytes=1536,
        cublas_workspace_bytes=CUBLAS_WORKSPACE_BYTES_SM90,
        cuda_context_bytes=CUDA_CONTEXT_BYTES,
    )
    assert extras.total_bytes == 1536 + CUBLAS_WORKSPACE_BYTES_SM90 + CUDA_CONTEXT_BYTES
    names = {f.name for f in dataclasses.fields(AcceleratorExtras)}
    assert set(AcceleratorExtras.source) == names
    assert "UNCONFIRMED" in AcceleratorExtras.source["cuda_context_bytes"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        extras.cuda_context_bytes = 0  # type: ignore[misc]


def test_no_torch_import() -> None:
    """The estimator imports this module; it must not pull torch in."""
    path = Path(__file__).resolve().parents[1] / "vram_widget" / "_estimating" / "accelerator.py"
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('accelerator', {str(path)!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "sys.modules['accelerator'] = module\n"
        "spec.loader.exec_module(module)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    # The file alone, not the package, whose __init__ imports torch-using modules.
    subprocess.run([sys.executable, "-c", code], check=True)


def test_nccl_buffers_by_hand_and_never_in_the_totals() -> None:
    # one connection: 4 MiB (SIMPLE) + 524,288 (LL) + 4,915,200 (LL128) = 9,633,792 B,
    # rounded up to 2 MiB: 10 MiB; a communicator: 16 channels x 2 ring connections
    assert nccl_connection_bytes() == 10 * 2**20
    a100 = nccl_buffers(1, 8, (8, 0))
    assert (a100.nbytes, a100.ring_bytes, a100.nvls_bytes) == (320 * 2**20, 320 * 2**20, 0)
    # H100 node of 8: NVLS adds 16 channels x 2 x (128 KiB x 8 steps) x 8 GPUs = 256 MiB
    h100 = nccl_buffers(2, 8, (9, 0))
    assert h100.nvls_bytes == 256 * 2**20 and h100.nbytes == 2 * 320 * 2**20 + 256 * 2**20
    assert nccl_buffers(1, 1, (9, 0)).nvls_bytes == 0  # one GPU in the node: no NVLS
    profile = profile_model(zoo.mlp(hidden=(8,)), input_size=(784,))
    with pytest.warns(UserWarning, match="the root .* holds 100%"):  # an MLP: one unit
        hsdp = profile.estimate(4, gpus=16, strategy="hsdp", compute_capability=(9, 0))
    assert hsdp.nccl == nccl_buffers(2, 8, (9, 0))  # shard and replicate groups
    assert profile.estimate(4, gpus=4, strategy="ddp").nccl == nccl_buffers(1, 4, (9, 0))
    assert hsdp.total_bytes == hsdp.peak_bytes + hsdp.extras.total_bytes  # not folded in
    assert profile.estimate(4).nccl is None  # one device
    assert profile.estimate(4, gpus=4, mode="inference").nccl is None  # not wrapped
    cpu = profile_model(zoo.mlp(hidden=(8,)), input_size=(784,), device="cpu")
    assert cpu.estimate(4, gpus=4).nccl is None  # gloo ranks on the CPU
