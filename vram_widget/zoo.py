"""A zoo of reference models in plain ``torch.nn``, for tests, benchmarks and notebooks.

Nothing here downloads anything: the vision models re-create torchvision's architectures
module for module (same submodule names, same parameter counts), and the sequence models are
small, hand-written stand-ins for the shapes of model people train (an encoder, a GPT-style
decoder, an LSTM, an embedding-dominated model, a Llama-style decoder with grouped-query
attention).

Two layers of API:

* factory functions (:func:`vgg16`, :func:`resnet50`, :func:`llama_decoder`, ...) that return
  a freshly initialised ``nn.Module``; they honour ``with torch.device("meta"):`` so even a
  70B-parameter model can be built without allocating memory;
* the registry :data:`ZOO` of :class:`ZooModel` entries, each pairing a builder with a
  deterministic example batch, sized so that one real fp32 training step (forward, backward,
  Adam) at batch 32 runs in about a second or less on a two-core CPU (VGG16, about two
  seconds, is the exception; see the note above :data:`ZOO`). These are the benchmark
  defaults.

Examples
--------
>>> import torch
>>> from vram_widget.zoo import zoo_model
>>> entry = zoo_model("mlp")
>>> model = entry.build()
>>> model(entry.make_inputs(4)).shape
torch.Size([4, 10])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "LLAMA_7B",
    "LLAMA_70B",
    "LLAMA_TINY",
    "ZOO",
    "LlamaConfig",
    "SequenceClassifierOutput",
    "ZooModel",
    "alexnet",
    "causal_decoder",
    "dict_input_classifier",
    "embedding_heavy",
    "llama_decoder",
    "llama_param_count",
    "lstm_classifier",
    "mlp",
    "mobilenet_v2",
    "resnet",
    "resnet18",
    "resnet50",
    "tied_autoencoder",
    "transformer_encoder",
    "vgg16",
    "zoo_model",
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


# --------------------------------------------------------------------------------------------
# Small non-vision models.
# --------------------------------------------------------------------------------------------


def mlp(
    in_features: int = 784,
    hidden: Sequence[int] = (512, 512),
    num_classes: int = 10,
    dropout: float = 0.1,
) -> nn.Module:
    """A multi-layer perceptron: (Linear, ReLU, Dropout) per hidden width, then a Linear.

    Parameters
    ----------
    in_features
        Width of the input vectors (784 = a flattened 28x28 image).
    hidden
        Widths of the hidden layers.
    num_classes
        Output width.
    dropout
        Dropout probability after each hidden activation.

    Returns
    -------
    nn.Sequential
        Takes ``(batch, in_features)`` floats, returns ``(batch, num_classes)`` logits.

    Examples
    --------
    >>> from vram_widget.zoo import mlp
    >>> mlp(hidden=(16,))(torch.zeros(3, 784)).shape
    torch.Size([3, 10])
    """
    layers: list[nn.Module] = []
    width = in_features
    for hidden_width in hidden:
        layers += [nn.Linear(width, hidden_width), nn.ReLU(), nn.Dropout(dropout)]
        width = hidden_width
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


class TransformerEncoderClassifier(nn.Module):
    """Token + learned position embeddings, ``nn.TransformerEncoder``, mean-pool, Linear."""

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        nhead: int,
        num_layers: int,
        dim_feedforward: int,
        max_len: int,
        dropout: float,
        num_classes: int,
    ):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(max_len, d_model)
        self.dropout = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(
            d_model, nhead, dim_feedforward=dim_feedforward, dropout=dropout, batch_first=True
        )
        # No padding mask is ever passed, so the nested-tensor path could never engage; turning
        # it off keeps PyTorch from warning about it and from probing the layer at build time.
        self.encoder = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.dropout(self.tok_emb(input_ids) + self.pos_emb(positions))
        x = self.encoder(x)
        return self.head(x.mean(dim=1))


def transformer_encoder(
    vocab_size: int = 1000,
    d_model: int = 128,
    nhead: int = 4,
    num_layers: int = 2,
    dim_feedforward: int = 512,
    max_len: int = 128,
    dropout: float = 0.1,
    num_classes: int = 10,
) -> nn.Module:
    """A small BERT-like sequence classifier built on ``nn.TransformerEncoder``.

    Parameters
    ----------
    vocab_size, d_model, nhead, num_layers, dim_feedforward, dropout
        As in ``nn.TransformerEncoderLayer`` / ``nn.TransformerEncoder`` (post-norm, ReLU).
    max_len
        Number of learned positions; inputs may be at most this long.
    num_classes
        Output width of the head applied to the mean of the token states.

    Returns
    -------
    nn.Module
        Takes int64 token ids ``(batch, seq_len)``, returns ``(batch, num_classes)`` logits.

    Examples
    --------
    >>> from vram_widget.zoo import transformer_encoder
    >>> transformer_encoder()(torch.zeros(2, 16, dtype=torch.long)).shape
    torch.Size([2, 10])
    """
    return TransformerEncoderClassifier(
        vocab_size, d_model, nhead, num_layers, dim_feedforward, max_len, dropout, num_classes
    )


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused QKV projection (GPT-2 layout)."""

    def __init__(self, d_model: int, n_head: int, dropout: float):
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_head ({n_head})")
        self.n_head = n_head
        self.dropout = dropout
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq_len, d_model = x.shape
        q, k, v = self.c_attn(x).split(d_model, dim=2)
        # (B, T, C) -> (B, heads, T, head_dim), the layout SDPA expects.
        q, k, v = (
            t.view(batch, seq_len, self.n_head, d_model // self.n_head).transpose(1, 2)
            for t in (q, k, v)
        )
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(batch, seq_len, d_model)
        return self.resid_dropout(self.c_proj(y))


class DecoderBlock(nn.Module):
    """Pre-norm GPT block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, d_model: int, n_head: int, dropout: float):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model),
            nn.GELU(),
            nn.Linear(4 * d_model, d_model),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class CausalDecoder(nn.Module):
    """A GPT-2-style language model (token + learned position embeddings, pre-norm blocks)."""

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        n_head: int,
        n_layer: int,
        max_len: int,
        dropout: float,
        tie_weights: bool,
    ):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(max_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(DecoderBlock(d_model, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        if tie_weights:
            # The same Parameter object under two modules: model.parameters() yields it once,
            # and its gradient accumulates from both uses (the GPT-2 convention).
            self.lm_head.weight = self.tok_emb.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.drop(self.tok_emb(input_ids) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def causal_decoder(
    vocab_size: int = 1000,
    d_model: int = 128,
    n_head: int = 4,
    n_layer: int = 2,
    max_len: int = 128,
    dropout: float = 0.1,
    tie_weights: bool = True,
) -> nn.Module:
    """A small GPT-style decoder using ``F.scaled_dot_product_attention(is_causal=True)``.

    Parameters
    ----------
    vocab_size, d_model, n_head, n_layer
        Vocabulary, width, heads and depth; the MLP is ``4 * d_model`` wide with GELU.
    max_len
        Number of learned positions; inputs may be at most this long.
    dropout
        Embedding, attention and residual dropout (attention dropout only in training mode).
    tie_weights
        Share one Parameter between the token embedding and the LM head.

    Returns
    -------
    nn.Module
        Takes int64 token ids ``(batch, seq_len)``, returns logits ``(batch, seq_len, vocab)``.

    Examples
    --------
    >>> from vram_widget.zoo import causal_decoder
    >>> model = causal_decoder()
    >>> model.lm_head.weight is model.tok_emb.weight
    True
    >>> model(torch.zeros(2, 8, dtype=torch.long)).shape
    torch.Size([2, 8, 1000])
    """
    return CausalDecoder(vocab_size, d_model, n_head, n_layer, max_len, dropout, tie_weights)


class LSTMClassifier(nn.Module):
    """Embedding, multi-layer ``nn.LSTM``, Linear on the last layer's final hidden state."""

    def __init__(
        self, vocab_size: int, embed_dim: int, hidden: int, num_layers: int, num_classes: int
    ):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embed_dim)
        self.lstm = nn.LSTM(embed_dim, hidden, num_layers=num_layers, batch_first=True)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        _, (h_n, _) = self.lstm(self.embedding(input_ids))
        return self.head(h_n[-1])


def lstm_classifier(
    vocab_size: int = 1000,
    embed_dim: int = 64,
    hidden: int = 128,
    num_layers: int = 2,
    num_classes: int = 10,
) -> nn.Module:
    """A recurrent sequence classifier on ``nn.LSTM(batch_first=True)``.

    Parameters
    ----------
    vocab_size, embed_dim
        Token embedding table shape.
    hidden, num_layers
        LSTM hidden width and depth.
    num_classes
        Output width.

    Returns
    -------
    nn.Module
        Takes int64 token ids ``(batch, seq_len)``, returns ``(batch, num_classes)`` logits.

    Examples
    --------
    >>> from vram_widget.zoo import lstm_classifier
    >>> lstm_classifier()(torch.zeros(2, 5, dtype=torch.long)).shape
    torch.Size([2, 10])
    """
    return LSTMClassifier(vocab_size, embed_dim, hidden, num_layers, num_classes)


class EmbeddingHeavy(nn.Module):
    """A big ``nn.Embedding`` (dense gradient), mean over tokens, Linear."""

    def __init__(self, vocab_size: int, embed_dim: int, num_classes: int):
        super().__init__()
        # sparse=False (the default): the gradient is a dense (vocab, dim) tensor however few
        # rows a batch touches, which is what makes this model's memory table-dominated.
        self.embedding = nn.Embedding(vocab_size, embed_dim)
        self.head = nn.Linear(embed_dim, num_classes)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(input_ids).mean(dim=1))


def embedding_heavy(
    vocab_size: int = 50_000, embed_dim: int = 64, num_classes: int = 10
) -> nn.Module:
    """A bag-of-tokens classifier whose memory is dominated by its embedding table.

    Parameters
    ----------
    vocab_size, embed_dim
        Table shape: 3.2M parameters (12.8 MB in fp32) at the defaults, against 650 in the head.
    num_classes
        Output width.

    Returns
    -------
    nn.Module
        Takes int64 token ids ``(batch, seq_len)``, returns ``(batch, num_classes)`` logits.

    Examples
    --------
    >>> from vram_widget.zoo import embedding_heavy
    >>> sum(p.numel() for p in embedding_heavy().parameters())
    3200650
    """
    return EmbeddingHeavy(vocab_size, embed_dim, num_classes)


class TiedAutoencoder(nn.Module):
    """An autoencoder whose decoder reuses the encoder's weight, transposed."""

    def __init__(self, in_features: int, hidden: int):
        super().__init__()
        self.encoder = nn.Linear(in_features, hidden)
        # Only the decoder's bias is its own; its weight is encoder.weight.t() (a view, so no
        # second copy), and the encoder weight's gradient sums the contributions of both uses.
        self.decoder_bias = nn.Parameter(torch.zeros(in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.encoder(x))
        return F.linear(h, self.encoder.weight.t(), self.decoder_bias)


def tied_autoencoder(in_features: int = 784, hidden: int = 128) -> nn.Module:
    """A one-hidden-layer autoencoder with tied encoder/decoder weights.

    Parameters
    ----------
    in_features
        Input (and reconstruction) width.
    hidden
        Code width.

    Returns
    -------
    nn.Module
        Takes ``(batch, in_features)`` floats and returns their reconstruction. Parameters:
        ``in_features * hidden + hidden + in_features`` (the shared weight counted once).

    Examples
    --------
    >>> from vram_widget.zoo import tied_autoencoder
    >>> sum(p.numel() for p in tied_autoencoder().parameters())
    101264
    """
    return TiedAutoencoder(in_features, hidden)


@dataclasses.dataclass
class SequenceClassifierOutput:
    """A Hugging Face-style model output: ``loss`` is None unless labels were given."""

    logits: torch.Tensor
    loss: torch.Tensor | None = None


class DictInputClassifier(nn.Module):
    """A keyword-input classifier with a Hugging Face-style output (for testing plumbing)."""

    def __init__(self, vocab_size: int, d_model: int, num_classes: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.head = nn.Linear(d_model, num_classes)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        labels: torch.Tensor | None = None,
    ) -> SequenceClassifierOutput:
        mask = attention_mask.unsqueeze(-1).to(self.embedding.weight.dtype)
        x = torch.tanh(self.proj(self.embedding(input_ids)))
        # Masked mean: padding positions contribute nothing (clamp guards an all-pad row).
        pooled = (x * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        logits = self.head(pooled)
        loss = None if labels is None else F.cross_entropy(logits, labels)
        return SequenceClassifierOutput(logits=logits, loss=loss)


def dict_input_classifier(
    vocab_size: int = 1000, d_model: int = 64, num_classes: int = 4
) -> nn.Module:
    """A model called as ``model(input_ids=..., attention_mask=..., labels=...)``.

    Parameters
    ----------
    vocab_size, d_model
        Embedding table shape.
    num_classes
        Output width.

    Returns
    -------
    nn.Module
        Returns a :class:`SequenceClassifierOutput` with ``logits`` ``(batch, num_classes)``
        and, when ``labels`` (int64, ``(batch,)``) is given, a scalar cross-entropy ``loss``.

    Examples
    --------
    >>> from vram_widget.zoo import zoo_model
    >>> entry = zoo_model("dict_input")
    >>> out = entry.build()(**entry.make_inputs(3))
    >>> out.logits.shape, out.loss.shape
    (torch.Size([3, 4]), torch.Size([]))
    """
    return DictInputClassifier(vocab_size, d_model, num_classes)


# --------------------------------------------------------------------------------------------
# Llama-style decoder.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The shape of a Llama-style decoder.

    Attributes
    ----------
    vocab_size, d_model, n_layer
        Vocabulary, residual width, number of blocks.
    n_head, n_kv_head
        Query heads and key/value heads; ``n_kv_head < n_head`` is grouped-query attention.
    ffn_hidden
        Width of the SwiGLU MLP's gate and up projections.
    max_len
        Longest supported sequence (rotary embeddings have no table, so this only validates).
    tie_weights
        Share the token embedding with the LM head.
    norm_eps, rope_theta
        RMSNorm epsilon and the rotary base.
    """

    vocab_size: int
    d_model: int
    n_layer: int
    n_head: int
    n_kv_head: int
    ffn_hidden: int
    max_len: int
    tie_weights: bool = False
    norm_eps: float = 1e-5
    rope_theta: float = 10_000.0

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head ({self.n_head}) must be a multiple of n_kv_head")
        if (self.d_model // self.n_head) % 2:
            raise ValueError("the head dimension must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


# Llama-2-7B and Llama-2-70B: Touvron et al. 2023, "Llama 2" (arXiv:2307.09288), Table 1 and
# section 2.2 (GQA for the 34B/70B models), with the exact sizes from Meta's released configs
# (meta-llama/Llama-2-7b-hf and -70b-hf config.json: hidden_size, intermediate_size,
# num_attention_heads, num_key_value_heads, num_hidden_layers, vocab_size,
# max_position_embeddings, rms_norm_eps=1e-5; untied embeddings).
LLAMA_7B = LlamaConfig(32000, 4096, 32, 32, 32, 11008, 4096)
LLAMA_70B = LlamaConfig(32000, 8192, 80, 64, 8, 28672, 4096)
# Same structure (GQA with 2 query heads per KV head), small enough for CPU tests.
LLAMA_TINY = LlamaConfig(
    vocab_size=1000, d_model=128, n_layer=2, n_head=4, n_kv_head=2, ffn_hidden=344, max_len=128
)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019), with a learned scale, no bias."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotary_cos_sin(
    seq_len: int, head_dim: int, theta: float, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables for positions ``0..seq_len-1`` (Su et al. 2021, arXiv:2104.09864).

    Computed per forward rather than cached in buffers, so the model's state is exactly its
    parameters (what the closed-form count describes) and meta/fake builds stay trivial. The
    half-split ("rotate_half") convention is Hugging Face's Llama implementation's.
    """
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    )
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


class LlamaAttention(nn.Module):
    """Bias-free grouped-query attention with rotary position embeddings."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.head_dim = config.head_dim
        kv_dim = config.n_kv_head * config.head_dim
        self.q_proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.k_proj = nn.Linear(config.d_model, kv_dim, bias=False)
        self.v_proj = nn.Linear(config.d_model, kv_dim, bias=False)
        self.o_proj = nn.Linear(config.d_model, config.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq_len, d_model = x.shape
        q = self.q_proj(x).view(batch, seq_len, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq_len, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq_len, self.n_kv_head, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        group = self.n_head // self.n_kv_head
        if group > 1:
            # Explicit repeat rather than SDPA's enable_gqa (torch>=2.5 only): works on every
            # supported torch, at the cost of materialising the repeated K/V, as many
            # implementations do.
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(batch, seq_len, d_model))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``, no biases."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.d_model, config.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(config.d_model, config.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(config.ffn_hidden, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.d_model, config.norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaDecoder(nn.Module):
    """A Llama-2-architecture language model (module names follow Hugging Face's)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(LlamaBlock(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seq_len = input_ids.shape[1]
        if seq_len > self.config.max_len:
            raise ValueError(f"sequence length {seq_len} exceeds max_len {self.config.max_len}")
        x = self.embed_tokens(input_ids)
        cos, sin = _rotary_cos_sin(
            seq_len, self.config.head_dim, self.config.rope_theta, x.device, x.dtype
        )
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def llama_decoder(config: LlamaConfig = LLAMA_TINY) -> nn.Module:
    """A Llama-2-style decoder: RMSNorm, SwiGLU, bias-free GQA attention, rotary positions.

    Builds on whatever device is current, so ``with torch.device("meta"):`` gives a
    shape-only model instantly, even for :data:`LLAMA_70B`. Weights keep PyTorch's default
    initialisation (a memory reference, not a training recipe); there is no dropout and no
    KV cache.

    Parameters
    ----------
    config
        The model's shape; :data:`LLAMA_TINY` by default.

    Returns
    -------
    nn.Module
        Takes int64 token ids ``(batch, seq_len)``, returns logits ``(batch, seq_len, vocab)``.
        Its parameter count is :func:`llama_param_count` of ``config``.

    Examples
    --------
    >>> from vram_widget.zoo import LLAMA_7B, llama_decoder
    >>> with torch.device("meta"):
    ...     model = llama_decoder(LLAMA_7B)
    >>> sum(p.numel() for p in model.parameters())
    6738415616
    """
    return LlamaDecoder(config)


def llama_param_count(config: LlamaConfig) -> int:
    """The parameter count of :func:`llama_decoder` of ``config``, in closed form.

    Per block: Q and O projections ``d^2`` each, K and V ``d * n_kv_head * head_dim`` each,
    SwiGLU ``3 * d * ffn_hidden``, two RMSNorm scales ``2 * d``. Plus the embedding
    ``vocab * d``, the final norm ``d`` and, unless tied, the LM head ``vocab * d``.

    Parameters
    ----------
    config
        The model's shape.

    Returns
    -------
    int

    Examples
    --------
    >>> from vram_widget.zoo import LLAMA_7B, LLAMA_70B, llama_param_count
    >>> llama_param_count(LLAMA_7B)  # Llama-2-7B
    6738415616
    >>> llama_param_count(LLAMA_70B)  # Llama-2-70B
    68976648192
    """
    d = config.d_model
    kv_dim = config.n_kv_head * config.head_dim
    per_block = 2 * d * d + 2 * d * kv_dim + 3 * d * config.ffn_hidden + 2 * d
    embeddings = config.vocab_size * d * (1 if config.tie_weights else 2)
    return embeddings + config.n_layer * per_block + d


# --------------------------------------------------------------------------------------------
# The registry.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ZooModel:
    """A reference model with an example batch.

    Attributes
    ----------
    name
        The key in :data:`ZOO`.
    build
        Returns a freshly initialised model (on the current default device).
    make_inputs
        ``make_inputs(batch_size)`` returns an example batch: a tensor (one positional
        argument) or a dict (keyword arguments), dim 0 the batch. Deterministic, and it
        leaves the global RNG alone (it draws from its own generator, seeded with 0).
    description
        One line for tables and widgets, input shape included.
    """

    name: str
    build: Callable[[], nn.Module]
    make_inputs: Callable[[int], Any]
    description: str


# Example batches are real CPU tensors even under ``with torch.device("meta"):`` (which would
# otherwise capture factory calls): they must hold the same values everywhere, and the caller
# moves or fakes them as needed.
_CPU = torch.device("cpu")


def _generator() -> torch.Generator:
    # A private, freshly seeded generator per call: the same batch every time, and the
    # caller's global RNG stream (e.g. their model's initialisation) is left untouched.
    return torch.Generator(device=_CPU).manual_seed(0)


def _image_batch(side_px: int) -> Callable[[int], torch.Tensor]:
    def make(batch_size: int) -> torch.Tensor:
        return torch.randn(batch_size, 3, side_px, side_px, generator=_generator(), device=_CPU)

    return make


def _feature_batch(num_features: int) -> Callable[[int], torch.Tensor]:
    def make(batch_size: int) -> torch.Tensor:
        return torch.randn(batch_size, num_features, generator=_generator(), device=_CPU)

    return make


def _token_batch(seq_len: int, vocab_size: int) -> Callable[[int], torch.Tensor]:
    def make(batch_size: int) -> torch.Tensor:
        return torch.randint(
            0, vocab_size, (batch_size, seq_len), generator=_generator(), device=_CPU
        )

    return make


_DICT_INPUT_SEQ_LEN = 32


def _dict_input_batch(batch_size: int) -> dict[str, torch.Tensor]:
    generator = _generator()
    input_ids = torch.randint(
        0, 1000, (batch_size, _DICT_INPUT_SEQ_LEN), generator=generator, device=_CPU
    )
    # Right-padded rows of varying length (at least one real token each), as a tokenizer
    # would return them.
    lengths = torch.randint(
        1, _DICT_INPUT_SEQ_LEN + 1, (batch_size, 1), generator=generator, device=_CPU
    )
    attention_mask = (torch.arange(_DICT_INPUT_SEQ_LEN, device=_CPU) < lengths).long()
    labels = torch.randint(0, 4, (batch_size,), generator=generator, device=_CPU)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


# Input sizes are the benchmark defaults. The vision models keep their exact ImageNet
# architectures and shrink the image instead (their adaptive pools accept small inputs).
# Measured real fp32 forward+backward+Adam step at batch 32, 2-core CPU, torch 2.13, on an
# otherwise idle machine: resnet50 ~1.0 s, alexnet ~0.65 s, resnet18 ~0.4 s, mobilenet_v2
# ~0.3 s, every sequence model and the MLPs ~0.1 s or less. VGG16 takes ~1.7-2.0 s and cannot
# be brought lower by the input: 32 px is already its minimum (five 2x2 pools), and about half
# the step is Adam over 138M parameters and the 124M-parameter classifier, neither of which
# depends on the image size. Use a smaller batch where that matters.
_ENTRIES: tuple[ZooModel, ...] = (
    ZooModel(
        "vgg16",
        vgg16,
        _image_batch(32),
        "VGG16, 138.4M params (fp32 weights+grads+Adam ~2.2 GB); images (B, 3, 32, 32)",
    ),
    ZooModel(
        "alexnet",
        alexnet,
        # 64 px: just above AlexNet's 63 px minimum.
        _image_batch(64),
        "AlexNet, 61.1M params; images (B, 3, 64, 64)",
    ),
    ZooModel("resnet18", resnet18, _image_batch(64), "ResNet-18, 11.7M params; (B, 3, 64, 64)"),
    ZooModel("resnet50", resnet50, _image_batch(64), "ResNet-50, 25.6M params; (B, 3, 64, 64)"),
    ZooModel(
        "mobilenet_v2",
        mobilenet_v2,
        _image_batch(64),
        "MobileNetV2, 3.5M params, depthwise convs; images (B, 3, 64, 64)",
    ),
    ZooModel("mlp", mlp, _feature_batch(784), "MLP 784-512-512-10; features (B, 784)"),
    ZooModel(
        "transformer_encoder",
        transformer_encoder,
        _token_batch(64, 1000),
        "nn.TransformerEncoder classifier, 2 layers d=128; token ids (B, 64)",
    ),
    ZooModel(
        "causal_decoder",
        causal_decoder,
        _token_batch(64, 1000),
        "GPT-style decoder with SDPA and tied LM head, 2 layers d=128; token ids (B, 64)",
    ),
    ZooModel(
        "lstm",
        lstm_classifier,
        _token_batch(32, 1000),
        "2-layer LSTM classifier, hidden 128; token ids (B, 32)",
    ),
    ZooModel(
        "embedding_heavy",
        embedding_heavy,
        _token_batch(16, 50_000),
        "50k x 64 embedding + mean + Linear; token ids (B, 16)",
    ),
    ZooModel(
        "tied_autoencoder",
        tied_autoencoder,
        _feature_batch(784),
        "784-128-784 autoencoder, decoder reuses encoder.weight.t(); features (B, 784)",
    ),
    ZooModel(
        "llama_tiny",
        llama_decoder,
        _token_batch(64, LLAMA_TINY.vocab_size),
        "Llama-style decoder (RMSNorm, SwiGLU, GQA 4q/2kv, RoPE), 2 layers d=128; "
        "token ids (B, 64)",
    ),
    ZooModel(
        "dict_input",
        dict_input_classifier,
        _dict_input_batch,
        "keyword inputs (input_ids, attention_mask, labels), output with .logits/.loss; "
        f"dict of (B, {_DICT_INPUT_SEQ_LEN}) ids and mask, (B,) labels",
    ),
)

ZOO: dict[str, ZooModel] = {entry.name: entry for entry in _ENTRIES}
"""The registry, by name. Entries are immutable; the dict is not, but treat it as read-only."""


def zoo_model(name: str) -> ZooModel:
    """Look up a :data:`ZOO` entry by name.

    Parameters
    ----------
    name
        A key of :data:`ZOO`.

    Returns
    -------
    ZooModel

    Raises
    ------
    KeyError
        If ``name`` is not in the zoo; the message lists the valid names.

    Examples
    --------
    >>> from vram_widget.zoo import zoo_model
    >>> zoo_model("resnet18").make_inputs(2).shape
    torch.Size([2, 3, 64, 64])
    >>> try:
    ...     zoo_model("nope")
    ... except KeyError as err:
    ...     print(err.args[0][:60])
    unknown zoo model 'nope'; valid names: vgg16, alexnet, resne
    """
    try:
        return ZOO[name]
    except KeyError:
        raise KeyError(f"unknown zoo model {name!r}; valid names: {', '.join(ZOO)}") from None
