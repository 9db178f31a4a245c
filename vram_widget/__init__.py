"""vram_widget: how much accelerator memory one training step of a torch.nn.Module needs."""

from ._estimator import MemoryEstimate
from ._options import Category, Device, Mode, OptimizerName, Phase, Precision
from ._profile import ModelProfile
from ._profiler import ProfilingError, profile_model

__all__ = [
    "Category",
    "Device",
    "MemoryEstimate",
    "Mode",
    "ModelProfile",
    "OptimizerName",
    "Phase",
    "Precision",
    "ProfilingError",
    "profile_model",
]
__version__ = "0.1.0"
