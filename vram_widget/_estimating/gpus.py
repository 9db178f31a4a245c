"""A small catalog of accelerators: memory size and dense peak TFLOP/s per dtype (no torch).

Conventions
-----------
* ``memory_bytes`` is the vendor's nominal capacity read as **binary** units (GiB = 2**30
  bytes): NVIDIA's "80GB", "24GB", ... are DRAM capacities built from power-of-two chips and
  stacks (an A100 80GB reports 81,920 MiB in ``nvidia-smi``). The exception is the H200, whose
  "141GB" is not a power-of-two capacity; it is taken as 141 GiB (UNCONFIRMED: the CUDA-visible
  total of an H200 is reported around 140 GiB). What CUDA can hand out is a little less on every
  card (driver reserve, ECC on GDDR cards such as the T4 and L4), and the CUDA context comes off
  the top: the estimate shows that as a separate reserve (``AcceleratorExtras``).
* ``tflops`` are **dense** peak TFLOP/s (no 2:4 structured sparsity; NVIDIA's data-center
  datasheets print the sparse figure with an asterisk, and the dense one is half of it).
  ``"fp32"`` is the non-tensor-core FP32 rate; ``"tf32"`` the TF32 tensor-core rate (what
  ``torch.backends.cuda.matmul.allow_tf32`` would use); ``"bf16"``/``"fp16"`` the tensor-core
  rates with FP32 accumulate (what PyTorch's matmuls use). Where a card has no tensor-core path
  for a dtype (TF32/BF16 before Ampere), the FP32 rate is given and the source says so.
* Every figure names its source; anything not read from the vendor's own document is marked
  UNCONFIRMED.
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = [
    "CUSTOM_GPU",
    "GPUS",
    "MIN_CAPACITY_BYTES",
    "TFLOPS_KEYS",
    "Gpu",
    "custom_gpu",
    "dtype_for_precision",
    "parse_capacity",
    "resolve_gpu",
]

_GIB = 2**30

TFLOPS_KEYS: tuple[str, ...] = ("fp32", "tf32", "bf16", "fp16")
"""The dtype keys every :attr:`Gpu.tflops` has."""

CUSTOM_GPU = "custom"
"""The name of the user-sized entry (``custom_gib``): memory only, no FLOP rate."""


@dataclass(frozen=True)
class Gpu:
    """One accelerator: memory and dense peak throughput, with where the numbers come from.

    Attributes
    ----------
    name
        Display name, e.g. ``"H100 SXM 80GB"``.
    memory_bytes
        Device memory in bytes (see the module notes on GB vs GiB).
    tflops
        Dense peak TFLOP/s keyed by ``"fp32"``, ``"tf32"``, ``"bf16"``, ``"fp16"``; empty for a
        custom entry.
    source
        The vendor document(s) the figures come from, and how they were read.
    compute_capability
        CUDA compute capability (major, minor), from NVIDIA's table
        (https://developer.nvidia.com/cuda-gpus); it sizes the cuBLAS workspace in the
        estimate's extras. None for a custom entry (the estimate then assumes 9.0).
    """

    name: str
    memory_bytes: int
    tflops: Mapping[str, float] = field(default_factory=dict)
    source: str = ""
    compute_capability: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0:
            raise ValueError(f"memory_bytes must be positive, got {self.memory_bytes}")
        object.__setattr__(self, "tflops", MappingProxyType(dict(self.tflops)))

    @property
    def memory_gib(self) -> float:
        """Memory in GiB."""
        return self.memory_bytes / _GIB

    def peak_flops_per_s(self, precision: str) -> float | None:
        """Dense peak FLOP/s for a :class:`~vram_widget.Precision` value, or None if unknown.

        Examples
        --------
        >>> GPUS["A100 80GB"].peak_flops_per_s("amp-bf16")
        312000000000000.0
        """
        rate = self.tflops.get(dtype_for_precision(precision))
        return None if rate is None else rate * 1e12


def dtype_for_precision(precision: str) -> str:
    """The :data:`TFLOPS_KEYS` entry whose rate bounds a step at ``precision``.

    fp32 maps to ``"fp32"`` (PyTorch's default: TF32 off for matmuls); ``amp-bf16``/``bf16``
    to ``"bf16"``; ``amp-fp16``/``fp16`` to ``"fp16"``.

    Examples
    --------
    >>> dtype_for_precision("amp-fp16")
    'fp16'
    """
    key = str(precision).lower()
    if key.endswith("bf16"):
        return "bf16"
    if key.endswith("fp16"):
        return "fp16"
    if key == "tf32":
        return "tf32"
    return "fp32"


def custom_gpu(memory_gib: float) -> Gpu:
    """A user-sized device: ``memory_gib`` GiB, no FLOP rates."""
    return Gpu(
        f"custom {memory_gib:g} GiB",
        round(memory_gib * _GIB),
        {},
        "user-supplied size (GiB = 2**30 bytes)",
    )


# Units of a capacity string, matched case-insensitively (no one means millibytes):
# * IEC binary prefixes as IEC 80000-13 defines them: KiB = 2**10, MiB = 2**20, GiB = 2**30,
#   TiB = 2**40 bytes; ``Ki``/``Mi``/``Gi``/``Ti`` as Kubernetes quantities spell them.
# * SI decimal prefixes with a B: kB = 10**3, MB = 10**6, GB = 10**9, TB = 10**12 bytes (SI;
#   IEC 80000-13). So the string "80GB" is 80 * 10**9 bytes, about 74.5 GiB: the unit read
#   literally. A catalog name such as "A100 80GB" is an entry of the catalog instead (its
#   vendor's "GB" is the card's binary capacity, see the module notes).
# * A bare letter K, M, G, T is binary, as GNU coreutils reads sizes ("'G' 'GiB' gibibyte:
#   2^30"; "'GB' gigabyte: 10^9": the coreutils manual, section "Block size",
#   https://www.gnu.org/software/coreutils/manual/html_node/Block-size.html) and as Docker's
#   ``--memory=80g`` and Slurm's ``--mem=80G`` do: "80G" is 80 GiB.
_UNITS: dict[str, int] = {
    "b": 1,
    **{f"{p}ib": 2 ** (10 * i) for i, p in enumerate("kmgt", 1)},
    **{f"{p}i": 2 ** (10 * i) for i, p in enumerate("kmgt", 1)},
    **{p: 2 ** (10 * i) for i, p in enumerate("kmgt", 1)},
    **{f"{p}b": 10 ** (3 * i) for i, p in enumerate("kmgt", 1)},
}
_CAPACITY = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]+)\s*$", re.IGNORECASE)
# No accelerator of interest has less: a number below this is a capacity in GiB or GB by
# mistake (``max_batch_size(80)`` meaning 80 GiB), which would otherwise silently fit nothing.
MIN_CAPACITY_BYTES = 2**20
_FORMS = (
    "a capacity is bytes (an int, e.g. 80 * 2**30), a string with a unit ('80GiB', "
    "'80G' or '80 GiB' = 80 * 2**30 bytes; '80GB' = 80 * 10**9; '512 MiB', '512M'), or a "
    "GPU name of the catalog (e.g. 'A100 80GB', 'H100')"
)


def resolve_gpu(value: Any) -> Gpu:
    """The device a capacity names: a catalog entry, or a custom entry of that many bytes.

    Every function that takes a capacity (``MemoryEstimate.fits``, ``fits_device``,
    ``ModelProfile.max_batch_size``, ``max_seq_len``, ``frontier``, ``min_gpus``, and
    ``show_memory(gpu=...)``) reads it here, so each form means the same everywhere.

    Parameters
    ----------
    value : Gpu, str or int
        * A :class:`Gpu`, returned as it is.
        * An int (or numpy integer): that many bytes, at least 1 MiB (a smaller number is
          most likely GiB or GB meant as bytes, ``fits(80)``, and is refused). Floats are
          refused, ``80.0`` as well as ``8.0e10``: bytes are whole, and a float is more
          often a size in GiB than in bytes; write ``"80GiB"`` or ``80 * 2**30``.
        * A string with a unit, case and spaces ignored: ``"80GiB"``, ``"80 gib"``,
          ``"80Gi"`` and ``"80G"`` are ``80 * 2**30`` bytes (IEC binary units; a bare
          ``K``/``M``/``G``/``T`` is binary as in GNU coreutils, Docker and Slurm);
          ``"80GB"``, ``"80 gb"`` are ``80 * 10**9`` bytes (SI decimal units, the unit read
          literally); ``"1.5TiB"`` takes a fraction; ``"80"`` (no unit) is refused.
        * A GPU name of the catalog (:data:`GPUS`), case and spaces ignored: ``"A100 80GB"``
          is that entry, 80 GiB (the vendor's "80GB" is the card's binary capacity: an A100
          80GB reports 81,920 MiB in ``nvidia-smi``; see the module notes). The words of a
          shorter name pick the entries holding them all: ``"H100"`` (the SXM and PCIe
          parts, both 80 GiB) is the first of them in the catalog, ``"H100 SXM 80GB"``;
          ``"A100"`` (40 and 80 GiB parts) is refused as ambiguous.

    Raises
    ------
    ValueError
        For anything else, naming the problem and the valid forms.

    Examples
    --------
    >>> resolve_gpu("A100 80GB").memory_bytes == 80 * 2**30
    True
    >>> resolve_gpu("24 GB").memory_bytes
    24000000000
    >>> resolve_gpu("24G").memory_bytes == resolve_gpu("24 GiB").memory_bytes == 24 * 2**30
    True
    >>> resolve_gpu("h100").name
    'H100 SXM 80GB'
    """
    if isinstance(value, Gpu):
        return value
    if isinstance(value, str):
        key = _catalog_key(value)
        for gpu in _ENTRIES:
            if _catalog_key(gpu.name) == key:
                return gpu
        match = _CAPACITY.match(value)
        unit = _UNITS.get(match.group(2).lower()) if match else None
        if match is not None and unit is not None:
            return _custom_bytes(round(float(match.group(1)) * unit), value)
        return _catalog_words(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):  # numpy ints too
        hint = ""
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            size = float(value)  # a small float is most likely GiB meant
            hint = f" (for {size:g} GiB write '{size:g}GiB')" if 0 < size < 2**20 else ""
        raise ValueError(
            f"capacity must be bytes (an int), a string with a unit or a GPU name, got "
            f"{value!r} ({type(value).__name__}){hint}: {_FORMS}"
        )
    return _custom_bytes(int(value), value)


def parse_capacity(value: Any) -> int:
    """Bytes of a capacity given in any form :func:`resolve_gpu` takes.

    Examples
    --------
    >>> parse_capacity("80GiB") == parse_capacity("80G") == 80 * 2**30
    True
    >>> parse_capacity("80GB")
    80000000000
    >>> parse_capacity("A100 80GB") == parse_capacity(80 * 2**30)
    True
    """
    return resolve_gpu(value).memory_bytes


def _catalog_words(value: str) -> Gpu:
    """The catalog entry whose name holds every word of ``value`` (see :func:`resolve_gpu`)."""
    words = set(value.lower().split())
    found = [g for g in _ENTRIES if words and words <= set(g.name.lower().split())]
    if not found:
        raise ValueError(f"unknown capacity or GPU {value!r}: {_FORMS}; catalog: {_names()}")
    if len({g.memory_bytes for g in found}) > 1:
        raise ValueError(
            f"GPU {value!r} is ambiguous: it names "
            + ", ".join(f"{g.name!r} ({g.memory_gib:g} GiB)" for g in found)
            + f"; give one of them, or a capacity: {_FORMS}"
        )
    return found[0]


def _custom_bytes(nbytes: int, given: Any) -> Gpu:
    if nbytes < MIN_CAPACITY_BYTES:
        meant = f" (did you mean {given!r} GiB, i.e. '{given}GiB'?)" if nbytes > 0 else ""
        if isinstance(given, str):
            meant = ""
        raise ValueError(
            f"capacity {given!r} is {nbytes:,} bytes, below 1 MiB: capacities are bytes"
            f"{meant}; {_FORMS}"
        )
    return Gpu(
        f"custom {nbytes / _GIB:.4g} GiB",
        nbytes,
        {},
        f"user-supplied capacity {given!r} (GiB = 2**30 bytes, GB = 10**9)",
    )


def _catalog_key(name: str) -> str:
    return re.sub(r"\s+", "", name).lower()


def _names() -> str:
    return ", ".join(repr(g.name) for g in _ENTRIES)


_H100_SXM_SRC = (
    "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column "
    "(https://www.nvidia.com/en-us/data-center/h100/): 80GB; FP32 67 TFLOPS; TF32 989, "
    "BF16 1,979, FP16 1,979 TFLOPS 'with sparsity' -> dense = half. Memory read as 80 GiB."
)

_ENTRIES: tuple[Gpu, ...] = (
    Gpu(
        "H100 SXM 80GB",
        80 * _GIB,
        {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5},
        _H100_SXM_SRC,
        compute_capability=(9, 0),
    ),
    Gpu(
        "H100 PCIe 80GB",
        80 * _GIB,
        {"fp32": 51.0, "tf32": 378.0, "bf16": 756.5, "fp16": 756.5},
        "NVIDIA H100 datasheet, H100 PCIe column "
        "(https://www.nvidia.com/en-us/data-center/h100/): 80GB HBM2e; FP32 51; TF32 756*, "
        "BF16 1,513*, FP16 1,513* TFLOPS (* with sparsity) -> dense = half. 80 GiB.",
        compute_capability=(9, 0),
    ),
    Gpu(
        "H200 SXM 141GB",
        141 * _GIB,
        {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5},
        "NVIDIA H200 datasheet (https://www.nvidia.com/en-us/data-center/h200/): 141GB HBM3e; "
        "FP32 67; TF32 989*, BF16 1,979*, FP16 1,979* TFLOPS (* with sparsity) -> dense = half. "
        "Memory taken as 141 GiB: UNCONFIRMED whether the vendor's 141GB is GB or GiB "
        "(CUDA-visible total reported near 140 GiB).",
        compute_capability=(9, 0),
    ),
    Gpu(
        "A100 80GB",
        80 * _GIB,
        {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
        "NVIDIA A100 datasheet (https://www.nvidia.com/en-us/data-center/a100/), SXM and PCIe "
        "columns: 80GB HBM2e; FP32 19.5; TF32 156 (312*); BF16 312 (624*); FP16 312 (624*) "
        "TFLOPS, * with sparsity. 80 GiB (nvidia-smi: 81,920 MiB).",
        compute_capability=(8, 0),
    ),
    Gpu(
        "A100 40GB",
        40 * _GIB,
        {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
        "NVIDIA A100 datasheet (https://www.nvidia.com/en-us/data-center/a100/): 40GB HBM2; "
        "same rates as the 80GB part (FP32 19.5; TF32 156; BF16/FP16 312 dense). 40 GiB.",
        compute_capability=(8, 0),
    ),
    Gpu(
        "L40S 48GB",
        48 * _GIB,
        {"fp32": 91.6, "tf32": 183.0, "bf16": 362.05, "fp16": 362.05},
        "NVIDIA L40S datasheet (https://www.nvidia.com/en-us/data-center/l40s/): 48GB GDDR6 "
        "with ECC; FP32 91.6; TF32 183 (366*); BF16 362.05 (733*); FP16 362.05 (733*) TFLOPS, "
        "* with sparsity. 48 GiB (less with ECC on).",
        compute_capability=(8, 9),
    ),
    Gpu(
        "L4 24GB",
        24 * _GIB,
        {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0},
        "NVIDIA L4 datasheet (https://www.nvidia.com/en-us/data-center/l4/): 24GB GDDR6; "
        "FP32 30.3; TF32 120*, BF16 242*, FP16 242* TFLOPS (* with sparsity) -> dense = half. "
        "24 GiB (less with ECC on). Dense halves UNCONFIRMED beyond the datasheet's footnote.",
        compute_capability=(8, 9),
    ),
    Gpu(
        "RTX 4090 24GB",
        24 * _GIB,
        {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2},
        "NVIDIA Ada GPU architecture whitepaper, GeForce RTX 4090 column "
        "(https://images.nvidia.com/aem-dam/Solutions/geforce/ada/"
        "nvidia-ada-gpu-architecture.pdf): 24GB GDDR6X; FP32 82.6; TF32 82.6 dense; "
        "FP16/BF16 tensor with FP32 accumulate 165.2 dense (330.4 with FP16 accumulate). "
        "24 GiB. UNCONFIRMED: figures recalled from the whitepaper, not re-read here.",
        compute_capability=(8, 9),
    ),
    Gpu(
        "RTX 3090 24GB",
        24 * _GIB,
        {"fp32": 35.6, "tf32": 35.6, "bf16": 71.0, "fp16": 71.0},
        "NVIDIA Ampere GA102 GPU architecture whitepaper, GeForce RTX 3090 column "
        "(https://www.nvidia.com/content/PDF/nvidia-ampere-ga-102-gpu-architecture-whitepaper-"
        "v2.pdf): 24GB GDDR6X; FP32 35.6; TF32 35.6 dense; FP16/BF16 tensor with FP32 "
        "accumulate 71 dense. 24 GiB. UNCONFIRMED: figures recalled, not re-read here.",
        compute_capability=(8, 6),
    ),
    Gpu(
        "T4 16GB",
        16 * _GIB,
        {"fp32": 8.1, "tf32": 8.1, "bf16": 8.1, "fp16": 65.0},
        "NVIDIA T4 datasheet (https://www.nvidia.com/en-us/data-center/tesla-t4/): 16GB "
        "GDDR6; FP32 8.1; mixed FP16/FP32 tensor 65 TFLOPS. Turing has no TF32 or BF16 tensor "
        "cores: the FP32 rate is given for them. 16 GiB (about 15 GiB visible with ECC on, "
        "UNCONFIRMED).",
        compute_capability=(7, 5),
    ),
    Gpu(
        "V100 SXM2 16GB",
        16 * _GIB,
        {"fp32": 15.7, "tf32": 15.7, "bf16": 15.7, "fp16": 125.0},
        "NVIDIA V100 datasheet (https://www.nvidia.com/en-us/data-center/v100/), SXM2 column: "
        "16GB HBM2; FP32 15.7; tensor (mixed FP16) 125 TFLOPS. Volta has no TF32 or BF16 "
        "tensor cores: the FP32 rate is given for them. 16 GiB.",
        compute_capability=(7, 0),
    ),
)

GPUS: dict[str, Gpu] = {gpu.name: gpu for gpu in _ENTRIES}
"""The catalog, keyed by display name, in the order the widget lists them."""
