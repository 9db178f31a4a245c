"""Branches on tensor values, decided for the fake run as the real step decides them."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from vram_widget._profiling.data_dependent import (
    example_mask_values,
    graph_randomness,
    masks_all_ones,
    worst_case_graph,
)

masking = pytest.importorskip("transformers.masking_utils")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.layerdrop = 0.2  # a module attribute, as BART's encoder keeps it

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.fc(input_ids.float())


def test_masks_all_ones_reads_the_examples_masks() -> None:
    net, ids = _Net(), torch.zeros(2, 4, dtype=torch.long)
    assert masks_all_ones(net, (ids,), {})  # no mask: the model makes an all-ones one
    assert masks_all_ones(net, (), {"input_ids": ids, "attention_mask": torch.ones(2, 4)})
    padded = torch.ones(2, 4)
    padded[0, -1] = 0
    assert not masks_all_ones(net, (ids, padded), {})  # positional, bound to its name
    meta = torch.ones(2, 4, device="meta")
    assert not masks_all_ones(net, (), {"input_ids": ids, "attention_mask": meta})  # unknown


def test_layerdrop_knobs_are_zeroed_and_restored() -> None:
    net = _Net()
    config = type("Config", (), {})()
    config.layerdrop, config.encoder_layerdrop, config.hidden_dropout = 0.1, 0.3, 0.1
    net.fc.config = config  # type: ignore[assignment]
    knobs = graph_randomness(net)
    assert sorted(name for _o, name, _v, _off in knobs) == [
        "encoder_layerdrop",
        "layerdrop",
        "layerdrop",
    ]  # dropout is not graph randomness: it masks values, every layer still runs
    with pytest.raises(RuntimeError), worst_case_graph(knobs):
        assert net.layerdrop == config.layerdrop == config.encoder_layerdrop == 0.0
        raise RuntimeError("a failing run")
    assert (net.layerdrop, config.layerdrop, config.encoder_layerdrop) == (0.2, 0.1, 0.3)


@dataclasses.dataclass(slots=True)
class _SlotsConfig:
    """A config without ``__dict__``, as torchtitan's ``@dataclass(slots=True)`` configs."""

    layerdrop: float = 0.25
    dim: int = 64


def test_layerdrop_knobs_on_a_slots_config_are_found() -> None:
    net = _Net()
    net.fc.config = _SlotsConfig()  # type: ignore[assignment]
    knobs = graph_randomness(net)
    assert sorted((type(o).__name__, name, v) for o, name, v, _off in knobs) == [
        ("_Net", "layerdrop", 0.2),
        ("_SlotsConfig", "layerdrop", 0.25),
    ]
    with worst_case_graph(knobs):
        assert net.fc.config.layerdrop == 0.0
    assert net.fc.config.layerdrop == 0.25


def _skip(padding_mask: Any, q_offset: Any = 0) -> bool:
    # q_length == kv_length == 4, kv_offset 0
    return bool(masking._ignore_causal_mask_sdpa(padding_mask, 4, 4, q_offset, 0))


def test_all_ones_example_mask_is_dropped_for_fake_masks_only() -> None:
    net, ids = _Net(), torch.zeros(2, 4, dtype=torch.long)
    original = masking._ignore_causal_mask_sdpa
    with FakeTensorMode() as fake:
        fake_mask = torch.ones(2, 4, dtype=torch.bool)
        fake_offset = torch.tensor(0)
    assert not _skip(fake_mask)  # transformers refuses any fake mask (is_tracing)
    with example_mask_values(net, (ids,), {}):
        assert _skip(fake_mask)
        assert _skip(None, fake_offset)  # a fake q_offset no longer forbids it either
        real = torch.ones(2, 4, dtype=torch.bool)
        real[0, 0] = False
        assert not _skip(real)  # real masks are read as they are
    assert masking._ignore_causal_mask_sdpa is original
    padded = torch.ones(2, 4)
    padded[1, -1] = 0
    with example_mask_values(net, (ids, padded), {}):
        assert not _skip(fake_mask)  # a padded example keeps the mask
    del fake


def test_packing_test_takes_the_examples_positions() -> None:
    net, ids = _Net(), torch.zeros(2, 4, dtype=torch.long)
    with FakeTensorMode():
        fake_positions = torch.arange(4).expand(2, 4)
    assert masking.find_packed_sequence_indices(fake_positions) is not None  # unreadable
    with example_mask_values(net, (ids,), {}):  # the model's own arange: one sequence a row
        assert masking.find_packed_sequence_indices(fake_positions) is None
    packed = torch.tensor([[0, 1, 0, 1], [0, 1, 2, 3]])  # two sequences in the first row
    with example_mask_values(net, (), {"input_ids": ids, "position_ids": packed}):
        assert masking.find_packed_sequence_indices(fake_positions) is not None
