"""vram_widget: how much accelerator memory one training step of a torch.nn.Module needs."""

from ._options import Category, Mode, OptimizerName, Phase, Precision

__all__ = ["Category", "Mode", "OptimizerName", "Phase", "Precision"]
__version__ = "0.1.0"
