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
    cuda_context,
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
    assert CUDA_CONTEXT_BYTES == cuda_context((9, 0)).nbytes == 775 * 2**20  # Hopper, lazy


@pytest.mark.parametrize(
    ("capability", "lazy", "mib", "kind"),
    [
        ((8, 9), True, 426, "measured"),  # RTX 6000 Ada, unsloth-zoo#1053
        ((9, 0), True, 775, "measured"),  # Hopper's row: an H200 (accuracy_cuda.json)
        ((9, 9), True, 775, "measured"),  # any minor of major 9 -> the (9, *) row
        ((10, 0), True, 775, "estimate"),  # Blackwell: Hopper's figure assumed
        ((8, 0), True, 400, "estimate"),  # A100: no row -> the any-GPU lazy row
        ((7, 0), False, 1343, "measured"),  # V100, eager: the Transformers docs
        ((8, 6), False, 1687, "measured"),  # RTX 3090, eager: pytorch#55277
        ((6, 1), False, 721, "measured"),  # GTX 1080, eager: pytorch#55277
        ((9, 0), False, 1343, "estimate"),  # no eager Hopper row -> the any-GPU eager row
    ],
)
def test_context_table_rows(capability: tuple[int, int], lazy: bool, mib: int, kind: str) -> None:
    row = cuda_context(capability, lazy_loading=lazy)
    assert row.nbytes == mib * 2**20
    assert row.source.startswith(f"{kind}:")
    if kind == "estimate":
        assert "UNCONFIRMED" in row.source


def test_estimate_names_the_context_it_used() -> None:
    profile = profile_model(zoo.mlp(), input_size=(784,), device="cuda")
    est = profile.estimate(4)  # default GPU: an H100 with lazy loading
    assert est.extras.cuda_context_bytes == 775 * 2**20
    assert est.extras.cuda_context_source == cuda_context((9, 0)).source
    ada = profile.estimate(4, compute_capability=(8, 9)).extras
    assert (ada.cuda_context_bytes, ada.cuda_context_source) == (
        426 * 2**20,
        cuda_context((8, 9)).source,
    )
    eager = profile.estimate(4, compute_capability=(7, 0), lazy_loading=False).extras
    assert eager.cuda_context_bytes == 1343 * 2**20
    assert profile_model(zoo.mlp(), input_size=(784,), device="cpu").estimate(
        4
    ).extras == AcceleratorExtras(0, 0, 0)


def test_given_context_reaches_every_consumer() -> None:
    profile = profile_model(zoo.mlp(), input_size=(784,), device="cuda")
    table, given = profile.estimate(4096), profile.estimate(4096, context_bytes=2**30)
    assert given.extras.cuda_context_bytes == 2**30
    assert given.extras.cuda_context_source == f"given: context_bytes={2**30}"
    delta = 2**30 - 775 * 2**20  # 1 GiB given instead of the table's 775 MiB
    assert given.total_bytes - table.total_bytes == delta
    assert table.device_bytes is not None and given.device_bytes is not None
    assert given.device_bytes - table.device_bytes == delta
    # a capacity that fits the table's context with room to spare but not the given one
    capacity = table.device_bytes + delta - 2**21
    assert table.fits(capacity) and not given.fits(capacity)
    by_table = profile.max_batch_size(capacity)
    by_given = profile.max_batch_size(capacity, context_bytes=2**30)
    assert 1 <= by_given < 4096 <= by_table
    assert profile.estimate(by_given, context_bytes=2**30).fits(capacity)
    assert not profile.estimate(by_given + 1, context_bytes=2**30).fits(capacity)
    # a capacity the given context fills is refused by the searches, naming the context
    with pytest.raises(ValueError, match="not above the CUDA context alone"):
        profile.max_batch_size(2**30, context_bytes=2**30)


@pytest.mark.parametrize("bad", [-1, 1.5, "1GB", True])
def test_given_context_must_be_bytes(bad: object) -> None:
    profile = profile_model(zoo.mlp(), input_size=(784,), device="cuda")
    with pytest.raises(ValueError, match="context_bytes must be a whole number of bytes"):
        profile.estimate(1, context_bytes=bad)


def test_lazy_loading_must_be_a_bool() -> None:
    profile = profile_model(zoo.mlp(), input_size=(784,), device="cuda")
    with pytest.raises(ValueError, match="lazy_loading must be True"):
        profile.estimate(1, lazy_loading="yes")


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
