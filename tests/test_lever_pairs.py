"""Levers composed two at a time: for every pair a real CPU step can check, the estimate from
the plain model's profile against ``measure()`` of the real libraries applying both
(torchtune's chunked loss, torch's checkpointing with torchtitan's policies, PEFT's LoRA,
gradient accumulation, the optimizer stepped in the backward), to the byte as each lever's
own tests are; FSDP2 on real gloo ranks within the byte bound of the FSDP2 tests; and the
pairs refused by design, refused by name with the valid forms."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from models import hf_llama, hf_tokens

from vram_widget import profile_model
from vram_widget._profiling.chunked_loss import torchtune_chunked_loss
from vram_widget._profiling.measure import measure

pytest.importorskip("transformers")
pytest.importorskip("peft")

# Hugging Face Llama (2 layers of 64, grouped key/value heads), fp32, batch 4 x 16 tokens;
# checkpoint_policy alone applies to checkpoint="auto"'s blocks; every 2nd block of two is
# the second
_CHUNKS = {"loss_chunks": 4}
_FULL = {"checkpoint": "auto"}
_OP = {"checkpoint_policy": "op"}
_EVERY_2ND = {"checkpoint_policy": 2}
_LORA = {"lora_rank": 4}
_ACCUMULATE = {"grad_accumulation": 2}
_IN_BACKWARD = {"optimizer_in_backward": True}

_PAIRS: dict[str, dict[str, Any]] = {
    "chunks+op": {**_CHUNKS, **_OP},
    "chunks+every2nd": {**_CHUNKS, **_EVERY_2ND},
    "chunks+in_backward": {**_CHUNKS, **_IN_BACKWARD},
    "full+lora": {**_FULL, **_LORA},
    "op+lora": {**_OP, **_LORA},
    "op+accumulate": {**_OP, **_ACCUMULATE},
    "full+in_backward": {**_FULL, **_IN_BACKWARD},
    "op+in_backward": {**_OP, **_IN_BACKWARD},
    "lora+accumulate": {**_LORA, **_ACCUMULATE},
    "lora+in_backward": {**_LORA, **_IN_BACKWARD},
}
# already checked beside the chunked loss's own tests (tests/test_chunked_loss.py): chunks
# with checkpoint="auto", LoRA and accumulation. A checkpoint policy stands for its family
# where a pair would repeat one (full + accumulation: op + accumulation)


@pytest.fixture(scope="module")
def llama() -> tuple[torch.nn.Module, Any]:
    torch.manual_seed(0)
    model = hf_llama()
    return model, profile_model(model, inputs=hf_tokens(2), device="cpu", cache=False)


@pytest.mark.parametrize("pair", list(_PAIRS))
def test_pair_estimate_equals_the_real_step(pair: str, llama: tuple[Any, Any]) -> None:
    levers = _PAIRS[pair]
    if "loss_chunks" in levers:
        try:
            torchtune_chunked_loss()
        except ImportError as exc:
            pytest.skip(str(exc))
    model, profile = llama
    est = profile.estimate(4, "fp32", "adamw", **levers)
    real = measure(model, hf_tokens(4, seed=4), optimizer="adamw", **levers)
    assert est.peak_bytes == real.peak_bytes, pair


# FSDP2 (zero3: fully_shard on each block and the root) with each single-process lever it
# composes with, on two real gloo ranks; each rank's peak against its estimate
_WITH_FSDP2: dict[str, dict[str, Any]] = {
    "full": _FULL,
    "lora": _LORA,
    "accumulate": _ACCUMULATE,
}


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("lever", list(_WITH_FSDP2))
def test_fsdp2_pair_ranks_against_their_estimate(lever: str, llama: tuple[Any, Any]) -> None:
    model, profile = llama
    levers = _WITH_FSDP2[lever]
    inputs = hf_tokens(2, seed=2)
    real = measure(model, inputs, optimizer="adamw", gpus=2, strategy="zero3", **levers)
    with pytest.warns(UserWarning, match="the root .* holds"):  # a 1,000-word vocabulary
        ests = [
            profile.estimate(2, "fp32", "adamw", gpus=2, strategy="zero3", rank=rank, **levers)
            for rank in range(2)
        ]
    for rank, (est, peak) in enumerate(zip(ests, real.rank_peak_bytes, strict=True)):
        assert est.peak_bytes == peak, (lever, rank, peak)


# refused by design, by name, before any run: the message names the pair and what is valid
_REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "chunks+fsdp2": (
        {**_CHUNKS, "gpus": 2, "strategy": "zero3"},
        r"loss_chunks=4 with strategy='zero3' on 2 GPUs: not estimated yet .*gpus=1",
    ),
    "in_backward+fsdp2": (
        {**_IN_BACKWARD, "gpus": 2, "strategy": "zero3"},
        r"optimizer_in_backward=True with strategy='zero3' on 2 GPUs: .*gpus=1",
    ),
    "in_backward+accumulate": (
        {**_IN_BACKWARD, **_ACCUMULATE},
        r"grad_accumulation > 1 cannot go with optimizer_in_backward=True.*grad_accumulation=1",
    ),
    "offload on the cpu": (
        {"offload_activations": "save_on_cpu", **_FULL},
        r"offload_activations='save_on_cpu' on a device='cpu' profile.*device='cuda'",
    ),
}


@pytest.mark.parametrize("pair", list(_REFUSED))
def test_pairs_refused_by_design_name_the_problem(pair: str, llama: tuple[Any, Any]) -> None:
    _model, profile = llama
    levers, message = _REFUSED[pair]
    runs = dict(profile._timelines)
    with pytest.raises(ValueError, match=message):
        profile.estimate(2, "fp32", "adamw", **levers)
    assert profile._timelines == runs  # refused before any profiling run


def test_offloading_with_fsdp2_is_refused_on_a_cuda_profile() -> None:
    torch.manual_seed(0)
    profile = profile_model(hf_llama(), inputs=hf_tokens(2), cache=False)
    for form in ("save_on_cpu", "torchtune"):
        with pytest.raises(ValueError, match=rf"offload_activations='{form}' with strategy="):
            profile.estimate(2, offload_activations=form, gpus=2, strategy="zero3")
