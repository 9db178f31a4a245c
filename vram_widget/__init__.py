"""vram_widget: how much accelerator memory one training step of a torch.nn.Module needs.

Re-exports only. Names are imported on first use (PEP 562), so that the numpy layer
(``_table``, ``_estimator``, ``_profile``) and the widget can be imported without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._options import Category, Device, Mode, OptimizerName, Phase, Precision

if TYPE_CHECKING:
    from ._accelerator import AcceleratorExtras
    from ._estimator import LayerTable, MemoryEstimate
    from ._gpus import GPUS, Gpu
    from ._levers import Levers
    from ._measure import Measurement, measure
    from ._profile import ModelProfile, ProfilingError
    from ._profiler import InputShapeWarning, profile_model
    from ._tradeoff import Frontier
    from ._widget import MemoryWidget, show_memory

_LAZY = {
    "AcceleratorExtras": "._accelerator",
    "GPUS": "._gpus",
    "Gpu": "._gpus",
    "Frontier": "._tradeoff",
    "Levers": "._levers",
    "LayerTable": "._estimator",
    "MemoryEstimate": "._estimator",
    "InputShapeWarning": "._profiler",
    "Measurement": "._measure",
    "measure": "._measure",
    "ModelProfile": "._profile",
    "ProfilingError": "._profile",
    "profile_model": "._profiler",
    "MemoryWidget": "._widget",
    "show_memory": "._widget",
}

__all__ = [
    "GPUS",
    "AcceleratorExtras",
    "Category",
    "Device",
    "Frontier",
    "Gpu",
    "InputShapeWarning",
    "LayerTable",
    "Levers",
    "Measurement",
    "MemoryEstimate",
    "MemoryWidget",
    "Mode",
    "ModelProfile",
    "OptimizerName",
    "Phase",
    "Precision",
    "ProfilingError",
    "measure",
    "profile_model",
    "show_memory",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
