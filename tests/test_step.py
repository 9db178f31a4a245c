"""Tests for ``step.py``: the default loss on every output shape, ``compute_loss``'s checks
and ``ModelInputs``. The estimate-vs-``measure()`` checks of the same output shapes are the
``*_output`` and ``hf_keywords`` cases of tests/test_profiler.py."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import pytest
import torch
from models import (
    CASES,
    OUTPUT_KINDS,
    ClassifierOutput,
    OutputKinds,
    SequenceClassifierOutputLike,
)

from vram_widget._profiling.step import (
    ModelInputs,
    compute_loss,
    default_loss,
    first_floating_tensor,
)


def _outputs(kind: str) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """The logits, the hidden features and the model's output for one output kind."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = OutputKinds(kind)
    x = torch.randn(4, 10, generator=torch.Generator().manual_seed(0))
    hidden = torch.sigmoid(model.body(x))
    return model.head(hidden), hidden, model(x)


@pytest.mark.parametrize("kind", OUTPUT_KINDS)
def test_default_loss_takes_the_logits_of_every_output_kind(kind: str) -> None:
    logits, hidden, output = _outputs(kind)
    loss = default_loss(output)
    assert loss.dim() == 0 and loss.requires_grad
    assert torch.equal(loss, logits.float().mean())
    assert not torch.equal(loss, hidden.float().mean())  # the other tensor would differ


def test_model_output_look_alike_behaves_like_hugging_face() -> None:
    logits, hidden = torch.ones(2, 3), torch.zeros(2, 4)
    out = SequenceClassifierOutputLike(logits=logits, hidden_states=hidden)
    assert out.loss is None and "loss" not in out  # None fields are not items
    assert list(out.keys()) == ["logits", "hidden_states"]
    assert out[0] is logits and out["hidden_states"] is hidden and out.logits is logits
    out.loss = torch.tensor(2.0)  # not an item before: stays an attribute only
    assert "loss" not in out and out.loss is not None


def test_default_loss_prefers_the_loss_field() -> None:
    logits = torch.randn(3, 5, requires_grad=True)
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor([0, 1, 2]))
    assert default_loss(SequenceClassifierOutputLike(loss=loss, logits=logits)) is loss
    # a plain dict's "loss" entry, wherever it sits
    assert default_loss({"logits": logits, "loss": loss}) is loss
    # a per-sample loss is averaged (in float32)
    per_sample = torch.arange(4.0, dtype=torch.bfloat16)
    got = default_loss({"logits": logits, "loss": per_sample})
    assert got.dtype == torch.float32 and got.item() == 1.5
    # an integer "loss" is no loss: the first floating tensor is used
    assert torch.equal(default_loss({"loss": torch.tensor(3), "logits": logits}), logits.mean())


def test_hf_style_model_with_labels_uses_its_loss() -> None:
    case = CASES["hf_keywords"]
    model = case.build()
    inputs = case.make_inputs(4)
    out = model(**inputs)
    expected = torch.nn.functional.cross_entropy(out.logits, inputs["labels"])
    assert out.loss is not None
    assert torch.equal(default_loss(out), expected)
    assert default_loss(out) is out.loss


@dataclasses.dataclass
class _Mixed:
    step: int
    ids: torch.Tensor
    scores: torch.Tensor
    extra: torch.Tensor


def test_dataclass_first_floating_field_in_declared_order() -> None:
    scores, extra = torch.full((2,), 3.0), torch.full((2,), 5.0)
    out = _Mixed(step=1, ids=torch.tensor([1, 2]), scores=scores, extra=extra)
    assert first_floating_tensor(out) is scores
    assert default_loss(out).item() == 3.0
    assert default_loss(ClassifierOutput(logits=extra)).item() == 5.0


def test_nested_outputs_are_searched_depth_first() -> None:
    a, b = torch.full((2,), 7.0), torch.full((2,), 9.0)
    point = collections.namedtuple("point", ["ids", "value"])
    assert first_floating_tensor(point(torch.tensor([1]), a)) is a
    assert first_floating_tensor(("text", [torch.tensor([1]), {"x": a}], b)) is a
    assert first_floating_tensor(b"bytes") is None
    assert first_floating_tensor({"name": "no tensors", "n": 3}) is None


def test_default_loss_without_floating_tensor() -> None:
    with pytest.raises(TypeError, match=r"no floating-point tensor.*\(got dict\).*loss_fn"):
        default_loss({"ids": torch.tensor([1, 2])})


def test_compute_loss_checks_the_user_loss() -> None:
    out = torch.randn(2, 3)
    assert torch.equal(compute_loss(out, lambda o: o.sum()), out.sum())
    with pytest.raises(ValueError, match=r"scalar tensor, got shape \(2, 3\)"):
        compute_loss(out, lambda o: o)
    with pytest.raises(TypeError, match="scalar tensor, got float"):
        compute_loss(out, lambda o: 1.0)


def test_model_inputs_from_user() -> None:
    x, mask = torch.zeros(5, 3), torch.ones(5, 3, dtype=torch.long)
    kw = ModelInputs.from_user({"input_ids": x, "attention_mask": mask})
    assert kw.args == () and kw.kwargs == {"input_ids": x, "attention_mask": mask}
    assert kw.batch_size() == 5
    pos = ModelInputs.from_user([x, mask])
    assert pos.args == (x, mask) and pos.kwargs == {}
    assert ModelInputs.from_user(x).args == (x,)
    # a 0-dim tensor has no batch dimension; the next tensor's dim 0 is the batch
    mixed = ModelInputs.from_user((torch.tensor(1.0), mask))
    assert mixed.batch_size() == 5
    with pytest.raises(ValueError, match="batch dimension"):
        ModelInputs.from_user({"t": torch.tensor(1.0), "n": 3}).batch_size()
