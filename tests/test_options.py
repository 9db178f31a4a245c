"""Tests for the option vocabulary: parsing precisions, optimizers, modes and batch sizes."""

from __future__ import annotations

import numpy as np
import pytest

from vram_widget._estimating.options import (
    CATEGORIES,
    CATEGORY_CODE,
    PHASE_CODE,
    PHASES,
    Category,
    Device,
    Mode,
    OptimizerName,
    Phase,
    Precision,
    parse_batch_size,
    parse_optimizer,
    parse_option,
)


@pytest.mark.parametrize(
    ("enum_type", "value", "expected"),
    [
        (Precision, "fp32", Precision.FP32),
        (Precision, "BF16", Precision.BF16),
        (Precision, "  amp-fp16 ", Precision.AMP_FP16),
        (Precision, Precision.FP16, Precision.FP16),
        (Mode, "Inference", Mode.INFERENCE),
        (Device, "CUDA", Device.CUDA),
        (OptimizerName, "SGD-Momentum", OptimizerName.SGD_MOMENTUM),
    ],
)
def test_parse_option_accepts_values_any_case(enum_type, value, expected) -> None:
    assert parse_option(enum_type, value, "x") is expected


@pytest.mark.parametrize(
    ("enum_type", "value", "what", "valid"),
    [
        (Precision, "fp8", "precision", "'fp32', 'bf16', 'fp16', 'amp-bf16', 'amp-fp16'"),
        (Mode, "eval", "mode", "'train', 'inference'"),
        (Device, "tpu", "device", "'cuda', 'cpu'"),
        (Precision, 32, "precision", "'fp32'"),
        (Precision, None, "precision", "'fp32'"),
        (Mode, Precision.FP32, "mode", "'train', 'inference'"),  # a member of another enum
    ],
)
def test_parse_option_errors_list_valid_values(enum_type, value, what, valid) -> None:
    with pytest.raises(ValueError) as info:
        parse_option(enum_type, value, what)
    message = str(info.value)
    assert message.startswith(f"unknown {what} {value!r}")
    assert f"valid values are {valid}" in message or valid in message


def test_enum_members_are_strings() -> None:
    assert Precision.AMP_BF16 == "amp-bf16"
    assert str(Precision.AMP_BF16) == "amp-bf16"
    assert f"{Mode.TRAIN}" == "train"


@pytest.mark.parametrize("value", [None, "none", "None", " NONE "])
def test_parse_optimizer_none(value) -> None:
    assert parse_optimizer(value) is None


@pytest.mark.parametrize("name", [o.value for o in OptimizerName])
def test_parse_optimizer_every_name(name: str) -> None:
    assert parse_optimizer(name) is OptimizerName(name)
    assert parse_optimizer(name.upper()) is OptimizerName(name)
    assert parse_optimizer(OptimizerName(name)) is OptimizerName(name)


@pytest.mark.parametrize("value", ["lion", "", 3, "adam-w"])
def test_parse_optimizer_errors(value) -> None:
    with pytest.raises(ValueError) as info:
        parse_optimizer(value)
    message = str(info.value)
    assert f"unknown optimizer {value!r}" in message
    assert (
        "'sgd', 'sgd-momentum', 'adam', 'adamw', 'adagrad', 'rmsprop', 'adamw8bit', "
        "'paged-adamw8bit', 'adamw8bit-torchao', 'adamw4bit-torchao', 'adafactor', or None"
    ) in message


@pytest.mark.parametrize(
    "value", [1, 7, 10**12, np.int64(3), np.int32(5), np.uint8(2), np.int64(2**40)]
)
def test_parse_batch_size_accepts_ints(value) -> None:
    out = parse_batch_size(value)
    assert out == int(value)
    assert type(out) is int


@pytest.mark.parametrize("value", [0, -1, np.int64(0), np.int64(-3)])
def test_parse_batch_size_rejects_non_positive(value) -> None:
    with pytest.raises(ValueError, match=r"batch_size must be >= 1, got -?\d"):
        parse_batch_size(value)


@pytest.mark.parametrize(
    ("value", "type_name"),
    [
        (True, "bool"),
        (False, "bool"),
        (np.bool_(True), "bool"),
        (2.0, "float"),
        (2.5, "float"),
        (np.float64(4.0), "float64"),
        ("8", "str"),
        (None, "NoneType"),
    ],
)
def test_parse_batch_size_rejects_non_ints(value, type_name: str) -> None:
    with pytest.raises(TypeError) as info:
        parse_batch_size(value)
    message = str(info.value)
    assert "batch_size must be a positive integer" in message
    assert f"({type_name})" in message


def test_codes_are_stable() -> None:
    assert tuple(Phase) == PHASES and tuple(Category) == CATEGORIES
    assert [PHASE_CODE[p] for p in PHASES] == list(range(len(PHASES)))
    assert [CATEGORY_CODE[c] for c in CATEGORIES] == list(range(len(CATEGORIES)))
    assert PHASE_CODE[Phase.FORWARD] == 0  # the recorder's initial phase
    assert [c.value for c in Category] == [
        "Parameter",
        "Buffer",
        "Gradient",
        "Optimizer state",
        "Activation",
        "Temporary",
        "Input",
        "Communication buffer",
        "KV cache",
    ]
