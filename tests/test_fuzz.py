"""Random but valid architectures: no exception, rows sum to totals, and the CPU estimate is
within 10 % of a measured CPU step (the bound asserted; in practice it is exact).

CI runs a small, derandomized sample; set VRAM_WIDGET_FUZZ_EXAMPLES=200 for a longer run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from vram_widget import measure, profile_model

EXAMPLES = int(os.environ.get("VRAM_WIDGET_FUZZ_EXAMPLES", "10"))
OPTIMIZERS = ["sgd", "sgd-momentum", "adam", "adamw", "adagrad", "rmsprop", None]


class Residual(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


@dataclass(frozen=True)
class Spec:
    kind: str  # "mlp" or "cnn"
    widths: tuple[int, ...]
    batchnorm: tuple[bool, ...]
    inplace: tuple[bool, ...]
    dropout: tuple[float, ...]
    pool: tuple[bool, ...]
    residual: tuple[bool, ...]

    def build(self) -> nn.Module:
        layers: list[nn.Module] = []
        width = 12 if self.kind == "mlp" else 3
        for i, out in enumerate(self.widths):
            block: list[nn.Module] = []
            if self.kind == "mlp":
                block.append(nn.Linear(width, out))
                if self.batchnorm[i]:
                    block.append(nn.BatchNorm1d(out))
            else:
                block.append(nn.Conv2d(width, out, 3, padding=1))
                if self.batchnorm[i]:
                    block.append(nn.BatchNorm2d(out))
            block.append(nn.ReLU(inplace=self.inplace[i]))
            if self.dropout[i]:
                block.append(nn.Dropout(self.dropout[i]))
            body = nn.Sequential(*block)
            layers.append(Residual(body) if self.residual[i] and out == width else body)
            if self.kind == "cnn" and self.pool[i]:
                layers.append(nn.MaxPool2d(2))
            width = out
        if self.kind == "cnn":
            layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        layers.append(nn.Linear(width, 10))
        return nn.Sequential(*layers)

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return (12,) if self.kind == "mlp" else (3, 16, 16)


@st.composite
def specs(draw: st.DrawFn) -> Spec:
    kind = draw(st.sampled_from(["mlp", "cnn"]))
    n = draw(st.integers(1, 3))

    def per_layer(strategy: st.SearchStrategy) -> tuple:  # type: ignore[type-arg]
        return tuple(draw(strategy) for _ in range(n))

    # Pooling halves 16 x 16 at most three times, so the map never vanishes.
    return Spec(
        kind=kind,
        widths=per_layer(st.sampled_from([3, 4, 8, 12, 16])),
        batchnorm=per_layer(st.booleans()),
        inplace=per_layer(st.booleans()),
        dropout=per_layer(st.sampled_from([0.0, 0.0, 0.1, 0.5])),
        pool=per_layer(st.booleans()),
        residual=per_layer(st.booleans()),
    )


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,  # the same examples in every CI run
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    spec=specs(),
    batch=st.integers(2, 12),  # BatchNorm in training needs more than one value per channel
    optimizer=st.sampled_from(OPTIMIZERS),
    train=st.booleans(),
)
def test_random_architectures(spec: Spec, batch: int, optimizer: str | None, train: bool) -> None:
    torch.manual_seed(0)
    model = spec.build()
    mode = "train" if train else "inference"
    profile = profile_model(model, input_size=spec.sample_shape, device="cpu")
    est = profile.estimate(batch, optimizer=optimizer, mode=mode)

    frame = est.to_dataframe()
    assert frame.param_bytes.sum() == est.parameter_bytes
    assert frame.gradient_bytes.sum() == est.gradient_bytes
    assert frame.optimizer_state_bytes.sum() == est.optimizer_state_bytes
    assert frame.activation_bytes.sum() == est.activation_bytes
    assert (frame.flops_forward + frame.flops_backward).sum() == est.flops

    real = measure(model, torch.zeros(batch, *spec.sample_shape), optimizer=optimizer, mode=mode)
    error = abs(est.peak_bytes - real.peak_bytes) / real.peak_bytes
    assert error <= 0.10, (spec, batch, optimizer, mode, est.peak_bytes, real.peak_bytes)
