"""The GPU catalog: every entry complete, sourced and in the right units."""

from __future__ import annotations

import numpy as np
import pytest

from vram_widget._estimating.gpus import (
    CUSTOM_GPU,
    GPUS,
    TFLOPS_KEYS,
    Gpu,
    custom_gpu,
    dtype_for_precision,
    parse_capacity,
    resolve_gpu,
)

GIB = 2**30


def test_catalog_size_and_names() -> None:
    assert len(GPUS) >= 10
    assert CUSTOM_GPU not in GPUS
    for name in ("H100 SXM 80GB", "H200 SXM 141GB", "A100 80GB", "T4 16GB", "RTX 4090 24GB"):
        assert name in GPUS


@pytest.mark.parametrize("gpu", list(GPUS.values()), ids=list(GPUS))
def test_entry_complete(gpu: Gpu) -> None:
    assert set(gpu.tflops) == set(TFLOPS_KEYS)
    assert all(v > 0 for v in gpu.tflops.values())
    assert gpu.source.count("http") >= 1
    assert 8 * GIB <= gpu.memory_bytes <= 256 * GIB
    # Tensor-core half precision is never slower than plain fp32.
    assert gpu.tflops["fp16"] >= gpu.tflops["fp32"]


def test_known_figures() -> None:
    h100 = GPUS["H100 SXM 80GB"]
    assert h100.memory_bytes == 80 * GIB
    assert h100.tflops["bf16"] == pytest.approx(1979 / 2, rel=1e-3)  # dense = sparse / 2
    a100 = GPUS["A100 80GB"]
    assert a100.tflops["tf32"] == 156.0
    assert a100.peak_flops_per_s("amp-bf16") == pytest.approx(312e12)
    assert GPUS["T4 16GB"].peak_flops_per_s("fp16") == pytest.approx(65e12)


def test_dtype_for_precision() -> None:
    assert dtype_for_precision("fp32") == "fp32"
    assert dtype_for_precision("bf16") == "bf16"
    assert dtype_for_precision("amp-bf16") == "bf16"
    assert dtype_for_precision("amp-fp16") == "fp16"


def test_custom_gpu_and_validation() -> None:
    g = custom_gpu(12)
    assert g.memory_bytes == 12 * GIB
    assert g.peak_flops_per_s("fp32") is None
    with pytest.raises(ValueError):
        Gpu("bad", 0)
    with pytest.raises(TypeError):
        h100 = GPUS["H100 SXM 80GB"]
        h100.tflops["fp32"] = 1.0  # type: ignore[index]


# --------------------------------------------------------------------------------------------
# Capacities: bytes, strings with a unit, catalog names
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "nbytes"),
    [
        (80 * 2**30, 80 * 2**30),
        (np.int64(2**30), 2**30),  # numpy ints are ints
        ("80GiB", 80 * 2**30),
        ("80 gib", 80 * 2**30),
        ("24 GB", 24 * 10**9),  # SI: GB = 10**9 bytes
        ("1.5 TiB", 3 * 2**39),
        ("512MiB", 2**29),
        ("2048 MB", 2048 * 10**6),
        ("A100 80GB", 80 * 2**30),  # a catalog entry (its vendor's GB read as GiB)
        ("a100 80gb", 80 * 2**30),  # case and spaces ignored
        ("H100SXM80GB", 80 * 2**30),
        # a bare K/M/G/T is binary (GNU coreutils' sizes, Docker's --memory, Slurm's --mem)
        ("80G", 80 * 2**30),  # 80 * 1,073,741,824 = 85,899,345,920
        ("80 g", 85_899_345_920),
        ("80Gi", 85_899_345_920),  # Kubernetes' spelling of GiB
        ("80 GiB", 85_899_345_920),
        ("80GB", 80_000_000_000),  # SI, the unit read literally: 80 * 10**9
        ("80gb", 80_000_000_000),
        ("512M", 2**29),  # 512 * 2**20 = 536,870,912
        ("1.5T", 1_649_267_441_664),  # 1.5 * 2**40
        ("2048 kB", 2_048_000),  # 2048 * 10**3
        # a catalog name's words pick the entries holding them all
        ("H100", 80 * 2**30),  # SXM and PCIe, both 80 GiB: the first, the SXM part
        ("h200", 141 * 2**30),  # 151,397,597,184
        ("L4", 24 * 2**30),  # the word L4, not the L40S
        ("t4", 16 * 2**30),
    ],
)
def test_capacity_forms(value: object, nbytes: int) -> None:
    assert parse_capacity(value) == nbytes


def test_catalog_names_resolve_to_their_entry() -> None:
    assert resolve_gpu("l4 24gb") is GPUS["L4 24GB"]
    assert resolve_gpu("H100") is GPUS["H100 SXM 80GB"]  # the first of equal capacities
    assert resolve_gpu("h100 pcie") is GPUS["H100 PCIe 80GB"]
    assert resolve_gpu("L4") is GPUS["L4 24GB"] and resolve_gpu("l40s") is GPUS["L40S 48GB"]
    custom = resolve_gpu("24 GiB")
    assert custom.name not in GPUS and custom.memory_bytes == 24 * 2**30 and not custom.tflops


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (80, r"80 bytes, below 1 MiB: capacities are bytes"),  # max_batch_size(80) for 80 GiB
        (0, r"below 1 MiB"),
        (-5, r"below 1 MiB"),
        ("0.5 KiB", r"below 1 MiB"),
        ("80", r"unknown capacity or GPU '80'"),
        ("80 XB", r"unknown capacity or GPU"),
        ("TPU v5", r"catalog: 'H100 SXM 80GB'"),
        (80.0, r"got 80.0 \(float\) \(for 80 GiB write '80GiB'\)"),
        (8.0e10, r"got 80000000000.0 \(float\)"),  # whole bytes as a float: refused too
        (np.float64(2**31), r"\(float64\)"),
        ("A100", r"'A100' is ambiguous: it names 'A100 80GB' \(80 GiB\), 'A100 40GB' \(40"),
        ("SXM", r"'SXM' is ambiguous"),  # H100 SXM 80GB, H200 SXM 141GB, V100 SXM2 is no match
        ("80 B", r"80 bytes, below 1 MiB"),
        (True, r"got True \(bool\)"),
        (None, r"got None"),
    ],
)
def test_bad_capacities_name_the_valid_forms(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        parse_capacity(value)
    assert "'80GiB'" in str(err.value) and "'A100 80GB'" in str(err.value)
