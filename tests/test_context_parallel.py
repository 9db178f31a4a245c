"""Context parallelism: one rank's step at seq_len / cp tokens, profiled under torch's own
``context_parallel`` ring attention on a fake process group, and the layouts and models
refused before any profiling. (Torch's ring attention has no CPU kernel, so there is no
real-rank comparison on this machine: docs/known-gaps.md.)"""

from __future__ import annotations

import pytest
import torch
from models import _LLAMA_SHAPE, hf_llama, hf_tokens

from vram_widget import profile_model

pytestmark = pytest.mark.timeout(300)
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama_profile():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    return profile_model(hf_llama(), inputs=hf_tokens(2), device="cuda")


def _row(est, name: str) -> int:  # type: ignore[no-untyped-def]
    return int(est.layers.activation_bytes[list(est.layers.name).index(name)])


def test_rank_runs_the_local_sequence(llama_profile) -> None:  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    est = llama_profile.estimate(2, "bf16", optimizer="adamw", seq_len=32, gpus=2, cp=2)
    local = llama_profile.estimate(2, "bf16", optimizer="adamw", seq_len=16)
    whole = llama_profile.estimate(2, "bf16", optimizer="adamw", seq_len=32)
    assert (est.gpus, est.cp, est.seq_len) == (2, 2, 32)
    # Every rank holds the whole model: 202,048 parameters x 2 B (bf16) = 404,096 B
    assert est.parameter_bytes == local.parameter_bytes == 404_096
    # The MLP's saved tensors are each (batch 2, local tokens 32 / 2 = 16, intermediate 128)
    # in bf16: 2 x 16 x 128 x 2 B = 8,192 B a row (gate_proj's output kept by SiLU,
    # up_proj's and SiLU's outputs kept by the product, the product kept by down_proj),
    # half of the whole sequence's 2 x 32 x 128 x 2 = 16,384 B
    for name in ("mlp.gate_proj", "mlp.up_proj", "mlp.act_fn", "mlp"):
        assert _row(est, f"model.layers.0.{name}") == 2 * 16 * 128 * 2
        assert _row(whole, f"model.layers.0.{name}") == 2 * 32 * 128 * 2
    # Attention keeps one tensor more than at 16 tokens alone: the ring's merged output
    # (_SDPAMerger, out - sigmoid(...) * (out - block_out)) is a contiguous (B, H, S, D)
    # tensor, so Llama's attn_output.transpose(1, 2).contiguous() copies it for o_proj,
    # where flash's own output is laid out (B, S, H, D) and needs no copy:
    # 2 x 4 heads x 16 tokens x 16 head dim x 2 B = 4,096 B
    assert _row(est, "model.layers.0.self_attn") - _row(local, "model.layers.0.self_attn") == (
        2 * 4 * 16 * 16 * 2
    )
    assert est.activation_bytes < whole.activation_bytes
    assert not dist.is_initialized()  # the fake group is gone


def test_bad_layouts_are_refused_by_name(llama_profile) -> None:  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    cases = [
        ({"gpus": 4, "cp": 2}, r"cp=2 with gpus=4: the cp ranks share one batch"),
        ({"gpus": 4, "cp": 2, "tp": 2}, r"cp=2 with tp=2"),
        ({"gpus": 2, "cp": 2, "strategy": "zero3"}, r"cp=2 with strategy='zero3'"),
        ({"gpus": 2, "cp": 2, "seq_len": 31}, r"cp=2 with seq_len=31: .* cp must divide"),
        ({"gpus": 2, "cp": 2, "checkpoint": "auto"}, r"cp=2 with checkpoint"),
        ({"gpus": 2, "cp": 2, "mode": "generate", "new_tokens": 4}, r"cp=2 with mode='generate'"),
        ({"gpus": 2, "cp": 0}, r"cp must be a whole number"),
    ]
    for keywords, message in cases:
        with pytest.raises(ValueError, match=message):
            llama_profile.estimate(2, **keywords)
    assert not dist.is_initialized()


def test_models_the_ring_cannot_shard_are_refused() -> None:
    import transformers

    eager = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**_LLAMA_SHAPE, attn_implementation="eager")
    )
    with pytest.raises(ValueError, match=r"attn_implementation='eager'"):
        profile_model(eager, inputs=hf_tokens(2), device="cuda").estimate(2, gpus=2, cp=2)
    masked = {**hf_tokens(2), "attention_mask": torch.ones(2, 16, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"the input 'attention_mask'"):
        profile_model(hf_llama(), inputs=masked, device="cuda").estimate(2, gpus=2, cp=2)
    with pytest.raises(ValueError, match=r"device='cuda' profiles only"):
        profile_model(hf_llama(), inputs=hf_tokens(2), device="cpu").estimate(2, gpus=2, cp=2)


def test_ring_refusal_names_the_backends_the_ring_cannot_run() -> None:
    from vram_widget._profiling.context_parallel import ring_refusal
    from vram_widget._profiling.cuda_sdpa import SdpaBackend

    def qk(seq: int, kv_heads: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        q = torch.empty(2, 4, seq, 16, dtype=dtype, device="meta")
        return q, torch.empty(2, kv_heads, seq, 16, dtype=dtype, device="meta")

    # fp32 with 4 query heads over 2 key/value heads: math (the ring has no math op)
    math = ring_refusal(2, SdpaBackend.MATH, *qk(32, 2, torch.float32), True)
    assert math is not None and "math backend" in math
    assert "mem-efficient refuses grouped-query heads" in math
    assert "got mixed torch.Tensor and DTensor" in math
    # mem-efficient pads its logsumexp to 32 rows; causal and load-balanced, each rank runs
    # q blocks of its whole local sequence and of its half:
    # seq 64 / cp 2 = 32 tokens, halves of 16: 16 % 32 != 0, refused; the nearest length
    # that works is 32 rows x 2 halves x 2 ranks = 128
    short = ring_refusal(2, SdpaBackend.EFFICIENT, *qk(64, 4, torch.float32), True)
    assert short is not None and "q blocks of 32 and 16 rows" in short
    assert "a multiple of 128" in short
    # seq 128 / cp 2 = 64 tokens, halves of 32: both multiples of 32
    assert ring_refusal(2, SdpaBackend.EFFICIENT, *qk(128, 4, torch.float32), True) is None
    # seq 256 / cp 4 = 64 tokens, halves of 32: runs; seq 128 / cp 4 = 32, halves of 16: not
    assert ring_refusal(4, SdpaBackend.EFFICIENT, *qk(256, 4, torch.float32), True) is None
    assert ring_refusal(4, SdpaBackend.EFFICIENT, *qk(128, 4, torch.float32), True)
    # flash and cuDNN return unpadded logsumexps
    for backend in (SdpaBackend.FLASH, SdpaBackend.CUDNN):
        assert ring_refusal(2, backend, *qk(32, 2, torch.bfloat16), True) is None


def test_fp32_runs_the_backend_an_h100_picks(llama_profile) -> None:  # type: ignore[no-untyped-def]
    import torch.distributed as dist
    import transformers

    # Llama's 4 query heads over 2 key/value heads in fp32: math on CUDA, refused by name
    # before the ring runs (a real step raises inside torch's math composite)
    with pytest.raises(ValueError, match=r"runs SDPA's math backend on CUDA \(float32, 4 query"):
        llama_profile.estimate(2, "fp32", optimizer="adamw", seq_len=32, gpus=2, cp=2)
    assert not dist.is_initialized()
    # Equal heads in fp32: the mem-efficient ring, where its logsumexp padding allows
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**_LLAMA_SHAPE, "num_key_value_heads": 4})
    prof = profile_model(transformers.LlamaForCausalLM(config), inputs=hf_tokens(2), device="cuda")
    with pytest.raises(ValueError, match=r"cp=2 with seq_len=64: .* mem-efficient kernel"):
        prof.estimate(2, "fp32", optimizer="adamw", seq_len=64, gpus=2, cp=2)
    est = prof.estimate(2, "fp32", optimizer="adamw", seq_len=128, gpus=2, cp=2)
    # each rank's MLP keeps (batch 2, 128 / 2 = 64 tokens, intermediate 128) fp32 tensors:
    # 2 x 64 x 128 x 4 B = 65,536 B a row
    for name in ("mlp.gate_proj", "mlp.up_proj", "mlp.act_fn", "mlp"):
        assert _row(est, f"model.layers.0.{name}") == 2 * 64 * 128 * 4
    assert not dist.is_initialized()


class _NoAttention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(32, 8)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.proj(self.embed(input_ids))


def test_a_step_without_sdpa_is_refused() -> None:
    import torch.distributed as dist

    ids = torch.zeros(2, 16, dtype=torch.long)
    prof = profile_model(
        _NoAttention(), inputs={"input_ids": ids}, loss_fn=lambda out: out.mean(), device="cuda"
    )
    with pytest.raises(ValueError, match=r"ran no F.scaled_dot_product_attention"):
        prof.estimate(2, gpus=2, cp=2)
    assert not dist.is_initialized()


def test_cp_flag_is_the_cp_keyword_checked_before_profiling(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from vram_widget._display.cli import main

    config = (
        "num_hidden_layers=2,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,"
        "intermediate_size=128,vocab_size=1000,bos_token_id=0,eos_token_id=0"
    )
    argv = ["--transformers", "llama", "--config", config, "--seq-len", "32", "--device",
            "cuda", "--batch-size", "2", "--precision", "bf16", "--json"]  # fmt: skip
    for bad, message in (
        (["--gpus", "4", "--cp", "2"], "--cp: cp=2 with gpus=4"),
        (["--gpus", "3", "--cp", "3"], "--cp: cp=3 with seq_len=32"),
    ):
        with pytest.raises(SystemExit) as info:
            main([*argv, *bad])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
    # the flags parsed (no model built): the estimate's keywords, the same as estimate()'s
    from vram_widget._display.cli import _estimate_keywords
    from vram_widget._display.cli_args import build_parser, validate

    parser = build_parser()
    args = validate(parser, parser.parse_args([*argv, "--gpus", "2", "--cp", "2"]))
    keywords = _estimate_keywords(args)
    assert (keywords["gpus"], keywords["cp"]) == (2, 2)


def test_measure_refuses_a_context_parallel_recipe() -> None:
    from vram_widget import Recipe, measure

    recipe = Recipe.from_keywords(gpus=2, cp=2)
    with pytest.raises(ValueError, match=r"the recipe's cp=2: context parallelism is not measured"):
        measure(hf_llama(), hf_tokens(2), recipe=recipe)
