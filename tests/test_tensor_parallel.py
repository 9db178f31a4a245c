"""Tensor parallelism: one rank's estimate from a sub-profile sharded by DTensor on PyTorch's
fake process group, and the layouts refused before any profiling."""

from __future__ import annotations

import pytest
import torch
from models import hf_llama, hf_tokens

from vram_widget import profile_model

pytestmark = pytest.mark.timeout(300)
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama_profile():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    return profile_model(hf_llama(), inputs=hf_tokens(2), device="cpu")


def test_rank_holds_its_shard_of_the_parameters(llama_profile) -> None:  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    est = llama_profile.estimate(2, "fp32", mode="inference", gpus=2, tp=2)
    full = llama_profile.estimate(2, "fp32", mode="inference")
    # Llama's plan shards every Linear and the embedding over 2 ranks and replicates the
    # 5 RMSNorm weights of 64 (2 per layer x 2 layers + the final norm): 5 x 64 x 4 B =
    # 1,280 B on every rank, the other 808,192 - 1,280 = 806,912 B halved: 403,456 + 1,280
    assert full.parameter_bytes == 808_192
    assert est.parameter_bytes == 403_456 + 1_280
    assert (est.gpus, est.tp) == (2, 2)
    assert est.peak_bytes < full.peak_bytes
    assert not dist.is_initialized()  # the fake group is gone


def test_bad_layouts_are_refused_by_name(llama_profile) -> None:  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    with pytest.raises(ValueError, match=r"tp=2 with gpus=1: gpus is the world size"):
        llama_profile.estimate(2, tp=2)
    with pytest.raises(ValueError, match=r"tp=2 with gpus=3"):
        llama_profile.estimate(2, gpus=3, tp=2)
    with pytest.raises(ValueError, match=r"data parallelism over tensor-parallel ranks"):
        llama_profile.estimate(2, gpus=4, tp=2)
    with pytest.raises(ValueError, match=r"strategy='zero3'"):
        llama_profile.estimate(2, gpus=2, tp=2, strategy="zero3")
    # 4 heads, 2 key/value heads: tp=4 does not divide the key/value heads
    with pytest.raises(ValueError, match=r"tp=4 does not divide the model's num_key_value_heads=2"):
        llama_profile.estimate(2, gpus=4, tp=4, mode="inference")
    with pytest.raises(ValueError, match=r"tp must be a whole number"):
        llama_profile.estimate(2, gpus=2, tp=0)
    assert not dist.is_initialized()


def test_a_model_without_a_plan_is_refused() -> None:
    from vram_widget import zoo

    entry = zoo.ZOO["mlp"]
    profile = profile_model(entry.build(), inputs=entry.make_inputs(2), device="cpu")
    with pytest.raises(ValueError, match=r"has no tensor-parallel plan"):
        profile.estimate(2, gpus=2, tp=2, mode="inference")


def test_the_fake_group_never_leaks() -> None:
    import torch.distributed as dist

    from vram_widget._profiling.tensor_parallel import fake_process_group

    with pytest.raises(KeyError), fake_process_group(2):
        assert dist.is_initialized()
        raise KeyError("midway")
    assert not dist.is_initialized()
    # a process already in a group: refused, its group left as it was
    with fake_process_group(2):
        with (
            pytest.raises(RuntimeError, match=r"already in a torch\.distributed process group"),
            fake_process_group(2),
        ):
            pass
        assert dist.is_initialized()
    assert not dist.is_initialized()
