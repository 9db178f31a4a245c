"""The vision models of the zoo: torchvision's VGG16, AlexNet, ResNet and MobileNetV2
architectures, rewritten module for module so that the zoo needs no torchvision."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "alexnet",
    "mobilenet_v2",
    "resnet",
    "resnet18",
    "resnet50",
    "vgg16",
]


# --------------------------------------------------------------------------------------------
# Vision: torchvision's architectures, rewritten so the zoo needs no torchvision.
#
# Parameter counts (torchvision's model documentation, "Params" column, which is
# ``sum(p.numel() for p in model.parameters())`` of the torchvision model with the default
# 1000 classes): VGG16 138,357,544; AlexNet 61,100,840; ResNet-18 11,689,512;
# ResNet-50 25,557,032; MobileNetV2 3,504,872. tests/test_zoo.py checks all five.
# Initialisation also follows torchvision, so weight statistics (and any value-dependent
# behaviour) match; it does not affect memory.
# --------------------------------------------------------------------------------------------

# torchvision.models.vgg.cfgs["D"]: numbers are conv output channels, "M" a 2x2 max-pool.
_VGG16_LAYOUT: tuple[int | str, ...] = (
    64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M",
)  # fmt: skip


def _init_vision(module: nn.Module, *, linear_std: float | None = 0.01) -> None:
    """torchvision's initialisation: Kaiming-normal convs, unit BatchNorm, N(0, 0.01) Linear.

    ``linear_std=None`` keeps PyTorch's default Linear init (torchvision's ResNet and AlexNet
    do not override it).
    """
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear) and linear_std is not None:
            nn.init.normal_(m.weight, 0.0, linear_std)
            nn.init.zeros_(m.bias)


class VGG(nn.Module):
    """torchvision's ``VGG``: ``features`` -> ``avgpool`` -> flatten -> ``classifier``."""

    def __init__(self, features: nn.Sequential, num_classes: int = 1000, dropout: float = 0.5):
        super().__init__()
        self.features = features
        # The adaptive pool is what lets a 32x32 image through a classifier sized for 224x224:
        # the 1x1 map left after five pools is replicated to 7x7.
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(p=dropout),
            nn.Linear(4096, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(p=dropout),
            nn.Linear(4096, num_classes),
        )
        _init_vision(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.classifier(x)


def vgg16(num_classes: int = 1000) -> nn.Module:
    """VGG16 (configuration "D", no batch norm), exactly as torchvision builds it.

    Parameters
    ----------
    num_classes
        Output width of the last Linear.

    Returns
    -------
    nn.Module
        138,357,544 parameters at ``num_classes=1000``. Module names match torchvision
        (``features.0``, ..., ``classifier.6``). Needs images of at least 32x32 (five 2x2
        pools).

    Examples
    --------
    >>> from vram_widget.zoo import vgg16
    >>> with torch.device("meta"):
    ...     model = vgg16()
    >>> sum(p.numel() for p in model.parameters())
    138357544
    """
    layers: list[nn.Module] = []
    in_channels = 3
    for item in _VGG16_LAYOUT:
        if item == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
        else:
            assert isinstance(item, int)
            layers += [
                nn.Conv2d(in_channels, item, kernel_size=3, padding=1),
                nn.ReLU(inplace=True),
            ]
            in_channels = item
    return VGG(nn.Sequential(*layers), num_classes=num_classes)


class AlexNet(nn.Module):
    """torchvision's ``AlexNet`` (the one-GPU variant of Krizhevsky's net, arXiv:1404.5997)."""

    def __init__(self, num_classes: int = 1000, dropout: float = 0.5):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, kernel_size=11, stride=4, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(64, 192, kernel_size=5, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(192, 384, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        self.classifier = nn.Sequential(
            nn.Dropout(p=dropout),
            nn.Linear(256 * 6 * 6, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(p=dropout),
            nn.Linear(4096, 4096),
            nn.ReLU(inplace=True),
            nn.Linear(4096, num_classes),
        )
        # torchvision's AlexNet keeps PyTorch's default initialisation throughout.

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.classifier(x)


def alexnet(num_classes: int = 1000) -> nn.Module:
    """AlexNet, exactly as torchvision builds it.

    Parameters
    ----------
    num_classes
        Output width of the last Linear.

    Returns
    -------
    nn.Module
        61,100,840 parameters at ``num_classes=1000``, torchvision's module names. Needs
        images of at least 63x63: the stride-4 11x11 conv and three 3x3/2 pools must leave a
        1x1 map (63 -> 15 -> 7 -> 3 -> 1).

    Examples
    --------
    >>> from vram_widget.zoo import alexnet
    >>> sum(p.numel() for p in alexnet().parameters())
    61100840
    """
    return AlexNet(num_classes=num_classes)


def _conv3x3(in_planes: int, out_planes: int, stride: int = 1, groups: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, 3, stride=stride, padding=1, groups=groups, bias=False)


def _conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, 1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """torchvision's ResNet ``BasicBlock`` (two 3x3 convs)."""

    expansion = 1

    def __init__(
        self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None
    ):
        super().__init__()
        self.conv1 = _conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        # One ReLU module called twice per forward, as in torchvision: hooks and estimators
        # must cope with a module that runs more than once.
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class Bottleneck(nn.Module):
    """torchvision's ResNet ``Bottleneck`` (1x1, 3x3, 1x1; the stride sits on the 3x3, "v1.5")."""

    expansion = 4

    def __init__(
        self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None
    ):
        super().__init__()
        self.conv1 = _conv1x1(inplanes, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = _conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """torchvision's ``ResNet`` trunk: stem, four stages, global average pool, ``fc``."""

    def __init__(
        self,
        block: type[BasicBlock | Bottleneck],
        blocks_per_stage: Sequence[int],
        num_classes: int = 1000,
        width: int = 64,
    ):
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_stage(block, width, blocks_per_stage[0], stride=1)
        self.layer2 = self._make_stage(block, width * 2, blocks_per_stage[1], stride=2)
        self.layer3 = self._make_stage(block, width * 4, blocks_per_stage[2], stride=2)
        self.layer4 = self._make_stage(block, width * 8, blocks_per_stage[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(width * 8 * block.expansion, num_classes)
        _init_vision(self, linear_std=None)

    def _make_stage(
        self, block: type[BasicBlock | Bottleneck], planes: int, num_blocks: int, stride: int
    ) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                _conv1x1(self.inplanes, planes * block.expansion, stride),
                nn.BatchNorm2d(planes * block.expansion),
            )
        layers: list[nn.Module] = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes) for _ in range(1, num_blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


# Blocks per stage, from He et al. 2015 (arXiv:1512.03385), Table 1, as torchvision uses them.
_RESNET_LAYOUTS: dict[int, tuple[type[BasicBlock | Bottleneck], tuple[int, int, int, int]]] = {
    18: (BasicBlock, (2, 2, 2, 2)),
    34: (BasicBlock, (3, 4, 6, 3)),
    50: (Bottleneck, (3, 4, 6, 3)),
    101: (Bottleneck, (3, 4, 23, 3)),
    152: (Bottleneck, (3, 8, 36, 3)),
}


def resnet(
    depth: Literal[18, 34, 50, 101, 152], num_classes: int = 1000, width: int = 64
) -> nn.Module:
    """A torchvision-architecture ResNet of the given depth.

    Parameters
    ----------
    depth
        18 or 34 (``BasicBlock``), 50, 101 or 152 (``Bottleneck``).
    num_classes
        Output width of ``fc``.
    width
        Channels of the stem and the first stage; stage ``i`` has ``width * 2**i`` (times 4 in
        a bottleneck's output). 64 is torchvision's; smaller widths give quick test models.

    Returns
    -------
    nn.Module

    Examples
    --------
    >>> from vram_widget.zoo import resnet
    >>> sum(p.numel() for p in resnet(34).parameters())  # torchvision's resnet34
    21797672
    >>> resnet(18, num_classes=10, width=8)(torch.zeros(2, 3, 32, 32)).shape
    torch.Size([2, 10])
    """
    if depth not in _RESNET_LAYOUTS:
        raise ValueError(f"depth must be one of {sorted(_RESNET_LAYOUTS)}, got {depth!r}")
    block, layout = _RESNET_LAYOUTS[depth]
    return ResNet(block, layout, num_classes=num_classes, width=width)


def resnet18(num_classes: int = 1000) -> nn.Module:
    """ResNet-18, exactly as torchvision builds it (11,689,512 parameters at 1000 classes).

    Parameters
    ----------
    num_classes
        Output width of ``fc``.

    Returns
    -------
    nn.Module

    Examples
    --------
    >>> from vram_widget.zoo import resnet18
    >>> sum(p.numel() for p in resnet18().parameters())
    11689512
    """
    return resnet(18, num_classes=num_classes)


def resnet50(num_classes: int = 1000) -> nn.Module:
    """ResNet-50 (v1.5), exactly as torchvision builds it (25,557,032 parameters).

    Parameters
    ----------
    num_classes
        Output width of ``fc``.

    Returns
    -------
    nn.Module

    Examples
    --------
    >>> from vram_widget.zoo import resnet50
    >>> sum(p.numel() for p in resnet50().parameters())
    25557032
    """
    return resnet(50, num_classes=num_classes)


def _make_divisible(value: float, divisor: int = 8) -> int:
    """torchvision's ``_make_divisible``: round to a multiple of ``divisor``, never below 90%."""
    new_value = max(divisor, int(value + divisor / 2) // divisor * divisor)
    if new_value < 0.9 * value:
        new_value += divisor
    return new_value


def _conv_bn_relu6(
    in_channels: int, out_channels: int, kernel_size: int = 3, stride: int = 1, groups: int = 1
) -> nn.Sequential:
    # torchvision's Conv2dNormActivation is an nn.Sequential subclass with exactly these three
    # children, so a plain Sequential gives the same module names (features.0.0, ...).
    return nn.Sequential(
        nn.Conv2d(
            in_channels,
            out_channels,
            kernel_size,
            stride=stride,
            padding=(kernel_size - 1) // 2,
            groups=groups,
            bias=False,
        ),
        nn.BatchNorm2d(out_channels),
        nn.ReLU6(inplace=True),
    )


class InvertedResidual(nn.Module):
    """MobileNetV2's block: 1x1 expand, 3x3 depthwise, 1x1 linear projection."""

    def __init__(self, inp: int, oup: int, stride: int, expand_ratio: int):
        super().__init__()
        self.stride = stride
        hidden_dim = round(inp * expand_ratio)
        self.use_res_connect = stride == 1 and inp == oup
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers.append(_conv_bn_relu6(inp, hidden_dim, kernel_size=1))
        layers += [
            _conv_bn_relu6(hidden_dim, hidden_dim, stride=stride, groups=hidden_dim),
            nn.Conv2d(hidden_dim, oup, 1, 1, 0, bias=False),
            nn.BatchNorm2d(oup),
        ]
        self.conv = nn.Sequential(*layers)
        self.out_channels = oup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_res_connect:
            return x + self.conv(x)
        return self.conv(x)


class MobileNetV2(nn.Module):
    """torchvision's ``MobileNetV2`` (Sandler et al. 2018, arXiv:1801.04381)."""

    # (expansion t, output channels c, repeats n, first stride s): the paper's Table 2.
    SETTINGS: tuple[tuple[int, int, int, int], ...] = (
        (1, 16, 1, 1),
        (6, 24, 2, 2),
        (6, 32, 3, 2),
        (6, 64, 4, 2),
        (6, 96, 3, 1),
        (6, 160, 3, 2),
        (6, 320, 1, 1),
    )

    def __init__(self, num_classes: int = 1000, width_mult: float = 1.0, dropout: float = 0.2):
        super().__init__()
        input_channel = _make_divisible(32 * width_mult)
        self.last_channel = _make_divisible(1280 * max(1.0, width_mult))
        features: list[nn.Module] = [_conv_bn_relu6(3, input_channel, stride=2)]
        for t, c, n, s in self.SETTINGS:
            output_channel = _make_divisible(c * width_mult)
            for i in range(n):
                stride = s if i == 0 else 1
                features.append(InvertedResidual(input_channel, output_channel, stride, t))
                input_channel = output_channel
        features.append(_conv_bn_relu6(input_channel, self.last_channel, kernel_size=1))
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(
            nn.Dropout(p=dropout), nn.Linear(self.last_channel, num_classes)
        )
        _init_vision(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = F.adaptive_avg_pool2d(x, (1, 1))
        x = torch.flatten(x, 1)
        return self.classifier(x)


def mobilenet_v2(num_classes: int = 1000, width_mult: float = 1.0) -> nn.Module:
    """MobileNetV2, exactly as torchvision builds it (3,504,872 parameters at the defaults).

    Parameters
    ----------
    num_classes
        Output width of the classifier's Linear.
    width_mult
        Channel multiplier; channel counts are rounded to multiples of 8 as in torchvision.

    Returns
    -------
    nn.Module
        Depthwise 3x3 convs, ``ReLU6``, and ``Dropout(0.2)`` before the classifier.

    Examples
    --------
    >>> from vram_widget.zoo import mobilenet_v2
    >>> sum(p.numel() for p in mobilenet_v2().parameters())
    3504872
    """
    return MobileNetV2(num_classes=num_classes, width_mult=width_mult)
