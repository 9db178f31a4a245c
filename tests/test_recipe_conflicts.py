"""A keyword given explicitly next to a Recipe must agree with it, even at its documented
default; one left out takes the recipe's value (every entry point that takes a recipe)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from vram_widget import ModelProfile, Recipe, profile_model


@pytest.fixture(scope="module")
def tokens() -> ModelProfile:
    emb = torch.nn.Embedding(100, 16)
    return profile_model(emb, inputs=torch.zeros(2, 8, dtype=torch.long), device="cpu")


BF16 = Recipe.from_keywords(precision="bf16", optimizer="sgd")

ENTRY_POINTS: dict[str, Callable[..., Any]] = {
    "estimate": lambda p, **kw: p.estimate(**kw),
    "max_batch_size": lambda p, **kw: p.max_batch_size("64 MiB", **kw),
    "max_seq_len": lambda p, **kw: p.max_seq_len("64 MiB", **kw),
    "min_gpus": lambda p, **kw: p.min_gpus("64 MiB", **kw),
    "frontier": lambda p, **kw: p.frontier("64 MiB", seq_lens=[8, 16], **kw),
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_an_explicit_default_that_disagrees_is_refused(tokens: ModelProfile, entry: str) -> None:
    call = ENTRY_POINTS[entry]
    # "fp32" is the keyword's documented default, but given explicitly it asks for fp32,
    # which the bf16 recipe does not hold: both are named
    with pytest.raises(ValueError, match=r"precision='fp32'.*step.precision='bf16'"):
        call(tokens, recipe=BF16, precision="fp32")
    with pytest.raises(ValueError, match=r"optimizer='adam'.*optimizer='sgd'"):
        call(tokens, recipe=BF16, optimizer="adam")


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_keywords_left_out_take_the_recipe(tokens: ModelProfile, entry: str) -> None:
    call = ENTRY_POINTS[entry]
    by_recipe = call(tokens, recipe=BF16)
    # the same setup by keywords, and by the recipe with keywords that agree with it
    assert _same(by_recipe, call(tokens, precision="bf16", optimizer="sgd"))
    assert _same(by_recipe, call(tokens, recipe=BF16, precision="bf16"))


def test_defaults_apply_without_a_recipe(tokens: ModelProfile) -> None:
    # the documented defaults: batch 1, fp32, Adam, training
    est = tokens.estimate()
    assert (est.batch_size, est.precision, est.optimizer, est.mode) == (1, "fp32", "adam", "train")
    # Embedding(100, 16): 1,600 fp32 weights = 6,400 B; Adam's two moments 2 x 6,400 B
    # plus its ``step``, a float32 0-dim tensor (torch/optim/adam.py, _init_group): 12,804 B
    assert est.parameter_bytes == 6400
    assert est.optimizer_state_bytes == 2 * 6400 + 4


def test_explicit_default_keyword_agreeing_with_the_recipe_is_fine(tokens: ModelProfile) -> None:
    fp32 = Recipe.from_keywords(batch_size=3)
    assert tokens.estimate(recipe=fp32, precision="fp32", batch_size=3).batch_size == 3
    with pytest.raises(ValueError, match=r"batch_size=1.*step.batch_size=3"):
        tokens.estimate(recipe=fp32, batch_size=1)


def test_frontier_takes_a_recipe(tokens: ModelProfile) -> None:
    by_recipe = tokens.frontier("64 MiB", seq_lens=[8, 64], recipe=BF16)
    by_keywords = tokens.frontier("64 MiB", "bf16", "sgd", seq_lens=[8, 64])
    assert by_recipe.max_batch_sizes.tolist() == by_keywords.max_batch_sizes.tolist()
    b = by_recipe.max_batch_at(64)
    assert tokens.estimate(recipe=BF16.with_(batch_size=b, seq_len=64)).fits(64 * 2**20)
    assert not tokens.estimate(recipe=BF16.with_(batch_size=b + 1, seq_len=64)).fits(64 * 2**20)


def _same(a: object, b: object) -> bool:
    if hasattr(a, "max_batch_sizes"):
        return a.max_batch_sizes.tolist() == b.max_batch_sizes.tolist()  # type: ignore[attr-defined]
    if hasattr(a, "peak_bytes"):
        return a.peak_bytes == b.peak_bytes  # type: ignore[attr-defined]
    return a == b


def test_measure_takes_a_recipe() -> None:
    from vram_widget import measure

    torch.manual_seed(0)
    model, x = torch.nn.Linear(8, 4), torch.randn(3, 8)
    recipe = Recipe.from_keywords(batch_size=3, precision="bf16", optimizer="adamw-foreach")
    by_recipe = measure(model, x, recipe=recipe)
    by_keywords = measure(model, x, optimizer="adamw-foreach", precision="bf16")
    assert by_recipe.peak_bytes == by_keywords.peak_bytes
    assert by_recipe.precision.value == "bf16" and by_recipe.optimizer.value == "adamw"
    # agreeing keywords are fine; an explicit default that disagrees names both
    assert measure(model, x, precision="bf16", recipe=recipe).peak_bytes == by_recipe.peak_bytes
    with pytest.raises(ValueError, match=r"precision='fp32'.*step.precision='bf16'"):
        measure(model, x, precision="fp32", recipe=recipe)
    # what a measured step cannot follow is refused by name, before the step runs
    with pytest.raises(ValueError, match=r"batch_size=5 is not the inputs' batch of 3"):
        measure(model, x, recipe=recipe.with_(batch_size=5))
    with pytest.raises(ValueError, match=r"the recipe's seq_len"):
        measure(model, x, recipe=recipe.with_(seq_len=16))
