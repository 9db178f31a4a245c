"""Models from other libraries, as users bring them: Hugging Face ``transformers``
architectures built from small configs (no download: nothing is fetched, weights are
random). Skipped where ``transformers`` is not installed (it is in the test extras).

torchvision and timm are not test dependencies; their models are plain
``nn.Module``s like the zoo's VGG16, AlexNet, ResNets and MobileNetV2, which follow the
torchvision architectures layer for layer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from models import HF_VOCAB, assert_model_unchanged, hf_gpt2, hf_llama, snapshot_model

from vram_widget import Mode, profile_model
from vram_widget._profiling.measure import measure

transformers = pytest.importorskip("transformers")

_VOCAB = HF_VOCAB


def _tokens(batch: int, seq: int = 16, labels_seq: int | None = None) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, _VOCAB, (batch, seq), generator=gen)
    labels = torch.randint(0, _VOCAB, (batch, labels_seq or seq), generator=gen)
    return {"input_ids": ids, "labels": labels}


def _classify(batch: int, seq: int = 16) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(batch)
    return {
        "input_ids": torch.randint(0, _VOCAB, (batch, seq), generator=gen),
        "labels": torch.randint(0, 3, (batch,), generator=gen),
    }


def _images(batch: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(batch)
    return {"pixel_values": torch.randn(batch, 3, 32, 32, generator=gen)}


def _bert() -> Any:
    config = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
        vocab_size=_VOCAB, num_labels=3,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config)


def _t5() -> Any:
    config = transformers.T5Config(
        num_layers=2, d_model=64, num_heads=4, d_ff=128, d_kv=16, vocab_size=_VOCAB,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(config)


def _vit() -> Any:
    config = transformers.ViTConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
        image_size=32, patch_size=8, num_labels=3,
    )  # fmt: skip
    return transformers.ViTForImageClassification(config)


_MODELS: dict[str, tuple[Callable[[], Any], Callable[[int], dict[str, torch.Tensor]]]] = {
    "gpt2": (hf_gpt2, _tokens),
    "bert": (_bert, _classify),
    "llama": (hf_llama, _tokens),
    "t5": (_t5, lambda b: _tokens(b, 16, 8)),
    "vit": (_vit, _images),
}


def _build(name: str) -> Any:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return _MODELS[name][0]()


def _assert_to_the_byte(estimated: int, measured: int, *where: object) -> None:
    """The estimate equals the measured peak. (Until the numbers a forward multiplies by were
    kept into the backward, cpu_rules.KEEPS_NUMBER_ARGS, GPT-2's and T5's Adam steps were
    48 and 8 bytes under and these allowed 0.01 %.)"""
    assert estimated == measured, (*where, estimated, measured)


@pytest.mark.parametrize("name", sorted(_MODELS))
def test_hugging_face_model_estimate_equals_measure(name: str) -> None:
    # Keyword batches, ModelOutput results and the model's own loss (output.loss), profiled
    # at batches 2, 3, 5 and estimated at 7: the CPU step's peak to the byte.
    model = _build(name)
    make = _MODELS[name][1]
    profile = profile_model(model, inputs=make(2), device="cpu")
    for optimizer, mode in (("adam", "train"), (None, "inference")):
        est = profile.estimate(7, "fp32", optimizer, mode)
        measured = measure(model, make(7), optimizer=optimizer, mode=mode)
        _assert_to_the_byte(est.peak_bytes, measured.peak_bytes, mode)


@pytest.mark.parametrize("name", sorted(_MODELS))
def test_hugging_face_model_profiles_for_cuda(name: str) -> None:
    # device="cuda" emulates CUDA's kernels (attention backends, foreach optimizers) on
    # the CPU: every precision and mode answers, and bf16 needs less than fp32.
    model = _build(name)
    profile = profile_model(model, inputs=_MODELS[name][1](2))
    fp32 = profile.estimate(8, "fp32", "adamw")
    bf16 = profile.estimate(8, "bf16", "adamw")
    amp = profile.estimate(8, "amp-fp16", "adamw")
    inference = profile.estimate(8, "fp16", None, "inference")
    assert 0 < bf16.peak_bytes < fp32.peak_bytes
    assert amp.parameter_bytes == fp32.parameter_bytes  # fp32 master weights
    assert 0 < inference.peak_bytes < bf16.peak_bytes
    # FLOPs are the forward's and backward's, whatever the optimizer (they may differ
    # between precisions: in bf16 CUDA picks a fused attention kernel, whose backward
    # recomputes the scores, one more matmul as torch.utils.flop_counter counts it)
    assert fp32.flops == profile.estimate(8, "fp32", "sgd").flops > 0


def test_hugging_face_root_row_shows_the_logits_shape() -> None:
    # A ModelOutput flattens to (loss, logits, ...): the root row shows the logits, not the
    # 0-dim loss.
    profile = profile_model(_build("gpt2"), inputs=_tokens(2), device="cpu")
    df = profile.estimate(4).to_dataframe()
    root = df[df["name"] == ""].iloc[0]
    assert root["output_shape"] == (4, 16, _VOCAB)
    assert root["output_numel"] == 4 * 16 * _VOCAB


def test_peak_in_the_roots_own_code_is_named() -> None:
    # GPT-2's loss runs in GPT2LMHeadModel.forward itself (no submodule): its backward peak
    # used to be reported in module '' (the root's qualified name). Now the root is named by
    # its class, and the autograd node running at the peak names the op.
    profile = profile_model(_build("gpt2"), inputs=_tokens(2), device="cpu")
    est = profile.estimate(8, "fp32", "adam")
    assert est.peak_phase.value == "backward"
    assert est.peak_module == "GPT2LMHeadModel"
    assert est.peak_op == "LogSoftmaxBackward0"  # the cross-entropy's log-softmax
    assert est.peak_location == "GPT2LMHeadModel: LogSoftmaxBackward0, backward"
    inference = profile.estimate(8, "fp32", None, "inference")
    assert inference.peak_location == "GPT2LMHeadModel: aten.nll_loss_forward, inference"


@pytest.mark.filterwarnings("ignore::FutureWarning")  # gradient_checkpointing_enable's rename
@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gradient_checkpointing_enabled_model_estimate_equals_measure(
    name: str, precision: str
) -> None:
    # Hugging Face's own gradient_checkpointing_enable (non-reentrant torch.utils.checkpoint
    # around each block). Before the profile held its parameters through the backward, bf16
    # raised CheckpointError (the recompute saw fp32 weights) and fp32 drifted with the batch
    # (+0.9 % at 3, +5.7 % at 7). With sdpa attention, as the models default to: the fake run
    # decides Hugging Face's mask skip as the real step does
    # (vram_widget/_profiling/data_dependent.py).
    model = _build(name)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    make = _MODELS[name][1]
    profile = profile_model(model, inputs=make(2), device="cpu")
    for batch in (3, 7):
        est = profile.estimate(batch, precision, "adam")
        measured = measure(model, make(batch), optimizer="adam", precision=precision)
        _assert_to_the_byte(est.peak_bytes, measured.peak_bytes, batch)
    # and for CUDA (the default device), in every precision: the recompute runs under the
    # same CUDA emulation as the forward
    cuda = profile_model(model, inputs=make(2))
    for prec in ("fp32", "bf16", "amp-bf16"):
        assert cuda.estimate(8, prec, "adamw").peak_bytes > 0


def _wav2vec2(layerdrop: float) -> Any:
    config = transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2, vocab_size=32, layerdrop=layerdrop,
        mask_time_prob=0.0,  # SpecAugment's random masks index by value: the real-run fallback
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.Wav2Vec2Model(config)


def _audio(batch: int) -> dict[str, torch.Tensor]:
    return {"input_values": torch.randn(batch, 800, generator=torch.Generator().manual_seed(0))}


def test_layerdrop_is_estimated_for_the_step_that_drops_no_layer() -> None:
    # wav2vec2's LayerDrop skips each layer with probability 0.5 in training: two runs drop
    # different layers (the fit failed, or was off by up to 30 %, by the seed). The estimate
    # is for the step that drops none, the worst case, and says so.
    model = _wav2vec2(layerdrop=0.5)
    with pytest.warns(UserWarning, match=r"layerdrop=0.5\): the training estimate is for the "):
        profile = profile_model(model, inputs=_audio(2), device="cpu")
    assert model.config.layerdrop == 0.5  # the model is left as it was
    every_layer = _wav2vec2(layerdrop=0.0)
    for batch in (3, 7):
        est = profile.estimate(batch, "fp32", "adam").peak_bytes
        assert est == measure(every_layer, _audio(batch), optimizer="adam").peak_bytes
        for seed in range(3):  # a real step drops layers, and needs no more than that
            torch.manual_seed(seed)
            assert measure(model, _audio(batch), optimizer="adam").peak_bytes <= est


def _mixtral() -> Any:
    config = transformers.MixtralConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=_VOCAB, num_local_experts=4, num_experts_per_tok=2,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.MixtralForCausalLM(config)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_mixture_of_experts_on_grouped_mm(precision: str) -> None:
    # transformers 5 runs Mixtral's experts through torch._grouped_mm, whose meta kernel
    # refuses anything but bf16 while the CPU and CUDA kernels run any dtype: the model could
    # not be profiled at all (profile_model runs fp32 first).
    model = _mixtral()
    assert model.config._experts_implementation == "grouped_mm"
    profile = profile_model(model, inputs=_tokens(2), device="cpu")
    for batch in (3, 7):
        for optimizer, mode in (("adam", "train"), (None, "inference")):
            est = profile.estimate(batch, precision, optimizer, mode)
            real = measure(model, _tokens(batch), optimizer=optimizer, mode=mode,
                           precision=precision)  # fmt: skip
            _assert_to_the_byte(est.peak_bytes, real.peak_bytes, batch, mode)
    cuda = profile_model(model, inputs=_tokens(2))
    assert 0 < cuda.estimate(8, "bf16").peak_bytes < cuda.estimate(8, "fp32").peak_bytes


# -- scaled-dot-product attention with grouped-query attention ------------------------------
#
# Hugging Face's sdpa attention (transformers/integrations/sdpa_attention.py) takes one of two
# paths for a model with fewer key/value heads than query heads: no attention mask ->
# F.scaled_dot_product_attention(..., is_causal=True, enable_gqa=True), which on the CPU runs
# _scaled_dot_product_flash_attention_for_cpu on the un-repeated k/v (no copies); a 4-D mask
# -> repeat_kv (an expand + reshape, i.e. (B, H, S, D) copies of k and v) and SDPA with the
# mask, which the same kernel saves for backward. The fake run reproduces either path to the
# byte. What it cannot do alone is choose: transformers/masking_utils.py drops a padding mask
# that holds only ones (_ignore_causal_mask_sdpa / _ignore_bidirectional_mask_sdpa), except
# when ``is_tracing(mask)``, which is True for every FakeTensor.


def _gqa_model(kind: str) -> Any:
    common = dict(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=_VOCAB, bos_token_id=0, eos_token_id=0,
        attn_implementation="sdpa",
    )  # fmt: skip
    config_type, model_type = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[kind]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return model_type(config_type(**common))


def _gqa_tokens(mask: str) -> Callable[[int], dict[str, torch.Tensor]]:
    def make(batch: int) -> dict[str, torch.Tensor]:
        inputs = _tokens(batch)
        if mask != "none":
            attention_mask = torch.ones(batch, 16, dtype=torch.long)
            if mask == "padded":
                attention_mask[:, -3:] = 0  # right padding in every sample
            inputs["attention_mask"] = attention_mask
        return inputs

    return make


def _sdpa_calls(model: Any, inputs: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    """The keyword arguments and k/v heads of each F.scaled_dot_product_attention call of a
    real forward (Hugging Face looks the function up at call time)."""
    calls: list[dict[str, Any]] = []
    original = torch.nn.functional.scaled_dot_product_attention

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        calls.append({**kwargs, "kv_heads": k.size(1), "q_heads": q.size(1)})
        return original(q, k, v, **kwargs)

    try:
        torch.nn.functional.scaled_dot_product_attention = spy  # type: ignore[assignment]
        with torch.no_grad():
            model(**inputs)
    finally:
        torch.nn.functional.scaled_dot_product_attention = original
    return calls


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("mask", ["none", "padded"])
def test_grouped_query_sdpa_estimate_equals_measure(kind: str, mask: str) -> None:
    # Both GQA paths on the CPU: enable_gqa=True (the CPU flash kernel reads the 2 k/v heads
    # as they are) and, with padding, repeat_kv copies plus the mask, all saved by
    # ScaledDotProductFlashAttentionForCpuBackward0. Both are exact; the reported +147,456
    # bytes per sample per layer (hidden E = 256, S = 64 tokens: the repeated k and v, 8*E*S,
    # plus the fp32 mask, 4*S^2) is the all-ones-mask case below, where the two runs take
    # different paths.
    model = _gqa_model(kind)
    make = _gqa_tokens(mask)
    calls = _sdpa_calls(model, make(2))
    assert len(calls) == 2
    if mask == "none":
        assert all(c.get("enable_gqa") and c["kv_heads"] == 2 for c in calls)
        assert all(c["attn_mask"] is None and c["is_causal"] for c in calls)
    else:
        assert all(not c.get("enable_gqa") and c["kv_heads"] == c["q_heads"] == 4 for c in calls)
        assert all(c["attn_mask"] is not None for c in calls)
    profile = profile_model(model, inputs=make(2), device="cpu")
    for optimizer, mode in (("adam", "train"), (None, "inference")):
        est = profile.estimate(7, "fp32", optimizer, mode)
        measured = measure(model, make(7), optimizer=optimizer, mode=mode)
        _assert_to_the_byte(est.peak_bytes, measured.peak_bytes, mode)


def test_grouped_query_sdpa_with_an_all_ones_mask_estimate_equals_measure() -> None:
    # transformers drops an all-ones padding mask only for non-fake tensors (its is_tracing
    # is True for a FakeTensor): the fake run kept the 4-D mask and took repeat_kv while the
    # real step runs enable_gqa without a mask (+2.4 %). The profile now decides the skip
    # from the example's mask values (vram_widget/_profiling/data_dependent.py).
    model = _gqa_model("llama")
    make = _gqa_tokens("ones")
    calls = _sdpa_calls(model, make(2))
    assert all(c.get("enable_gqa") and c["attn_mask"] is None for c in calls)  # the real step
    profile = profile_model(model, inputs=make(2), device="cpu")
    for optimizer, mode in (("adam", "train"), (None, "inference")):
        est = profile.estimate(7, "fp32", optimizer, mode)
        measured = measure(model, make(7), optimizer=optimizer, mode=mode)
        _assert_to_the_byte(est.peak_bytes, measured.peak_bytes, mode)


# -- the sequence axis -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama"])
def test_sequence_length_estimate_equals_measure(name: str) -> None:
    # Profiled at 16 tokens; input_ids (and a causal LM's labels) are the sequence axis found
    # by default. Another length is exact (profiled at that length, cached).
    model = _build(name)
    make = {"gpt2": _tokens, "llama": _tokens, "bert": _classify}[name]
    profile = profile_model(model, inputs=make(2), device="cpu")
    assert profile.has_seq_axis and profile.seq_len == 16
    for seq in (9, 40):
        for optimizer, mode in (("adam", "train"), (None, "inference")):
            est = profile.estimate(3, "fp32", optimizer, mode, seq_len=seq)
            real = measure(model, make(3, seq), optimizer=optimizer, mode=mode)
            _assert_to_the_byte(est.peak_bytes, real.peak_bytes, seq, mode)


def test_learned_positions_bound_the_sequence() -> None:
    # GPT-2's wpe has n_positions = 64 rows here: a real step past it indexes out of range
    profile = profile_model(_build("gpt2"), inputs=_tokens(2), device="cpu")
    assert profile.seq_len_limit == 64
    with pytest.raises(ValueError, match=r"seq_len=65 is beyond the model's 64 learned positions"):
        profile.estimate(2, seq_len=65)
    assert profile.max_seq_len("1 GiB", batch_size=1) == 64
    assert profile_model(_build("llama"), inputs=_tokens(2)).seq_len_limit is None  # rotary


def test_a_sequence_past_the_position_table_is_refused_before_profiling() -> None:
    # GPT-2 here has n_positions = 64 (config.max_position_embeddings through the config's
    # attribute_map): 65 tokens would index past wpe in a real step. Refused by profile_model
    # and show_memory, before any run, the model left as it was.
    from vram_widget import show_memory

    model = _build("gpt2")
    before = snapshot_model(model)
    message = (
        r"the inputs' sequence length 65 \(input_ids, dim 1\) is beyond the model's 64 "
        r"learned positions \(config.max_position_embeddings; GPT-2's n_positions\)"
    )
    with pytest.raises(ValueError, match=message):
        profile_model(model, inputs=_tokens(2, 65))
    with pytest.raises(ValueError, match=message):
        show_memory(model, inputs=_tokens(2, 65), device="cpu")
    assert_model_unchanged(model, before)
    assert profile_model(model, inputs=_tokens(2, 64), device="cpu").seq_len == 64  # the limit


def test_profiling_keeps_third_party_log_and_warnings_from_the_user(
    capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    # transformers logs "`loss_type=None` was set in the config but it is unrecognized"
    # (PreTrainedModel.loss_function, logger.warning_once: once per process, so its cache
    # is cleared here) from every GPT-2 forward with labels. Nothing reaches stdout or
    # stderr, and no log record or warning is left for the user; vram_widget's own warning
    # (an input_size that starts with a batch size) still does.
    import io
    import logging
    import warnings

    from transformers.utils import logging as hf_logging

    from vram_widget import InputShapeWarning

    model = _build("gpt2")
    # transformers' own handler holds the stderr of its import; this one sees what it sees
    heard = io.StringIO()
    handler = logging.StreamHandler(heard)
    logging.getLogger("transformers").addHandler(handler)
    try:
        capfd.readouterr()
        hf_logging.warning_once.cache_clear()
        with caplog.at_level(logging.WARNING), warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            profile = profile_model(model, inputs=_tokens(2), device="cpu")
            profile.estimate(4, "bf16", "adamw")  # a run made later, by an estimate
        assert capfd.readouterr() == ("", "")
        assert heard.getvalue() == ""
        assert [r.getMessage() for r in caplog.records] == []
        assert [str(w.message) for w in seen] == []
        # the same message outside a profile does reach the user: the test can hear it
        hf_logging.warning_once.cache_clear()
        model(**_tokens(2))
        assert "`loss_type=None` was set in the config" in heard.getvalue()
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    # vram_widget's own warning passes
    with pytest.warns(InputShapeWarning, match="common batch size"):
        profile_model(torch.nn.Linear(8, 8), input_size=(32, 8), device="cpu")


def test_quiet_third_party_passes_our_warnings_and_the_users_own() -> None:
    # Inside the block: numpy's RuntimeWarning (issued in site-packages) is kept back; a
    # warning of vram_widget's, and one of code outside any installed library (this
    # test's own, as a user's model would), reach the user.
    import warnings

    from vram_widget._profiling.fake import quiet_third_party
    from vram_widget._profiling.source_runs import warn_fallback

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet_third_party():
            np.mean(np.zeros(0))  # numpy: "Mean of empty slice", "invalid value ..."
            warn_fallback("a test reason")
            warnings.warn("the user's own", UserWarning, stacklevel=1)
        np.mean(np.zeros(0))  # after the block: shown again
    messages = [str(w.message) for w in seen]
    assert len(messages) == 4, messages
    assert "a test reason" in messages[0] and messages[1] == "the user's own"
    assert messages[2] == "Mean of empty slice"
    assert messages[3].startswith("invalid value encountered")


def test_encoder_decoder_lengths_that_differ_need_an_explicit_axis() -> None:
    # T5: 16 encoder tokens, 8 label tokens. One axis is supported: none by default (and an
    # estimate at a length says why), or the encoder's, named.
    model = _build("t5")
    profile = profile_model(model, inputs=_tokens(2, 16, 8), device="cpu")
    assert not profile.has_seq_axis
    with pytest.raises(ValueError, match=r"different lengths .*input_ids: \(2, 16\)"):
        profile.estimate(2, seq_len=32)
    encoder = profile_model(
        model, inputs=_tokens(2, 16, 8), device="cpu", seq_axis={"input_ids": 1}
    )
    est = encoder.estimate(3, "fp32", "adam", seq_len=24)
    real = measure(model, _tokens(3, 24, 8), optimizer="adam")
    _assert_to_the_byte(est.peak_bytes, real.peak_bytes)


def test_sliding_window_bounds_the_fit_in_the_length() -> None:
    # Mistral's sliding window (80 here): from 80 tokens on, Hugging Face materializes the
    # mask it skips below (masking_utils: kv_length >= local_attention_size), so memory
    # changes form there. The fit in the length (runs at 16, 33, 50, checked at 67: all
    # below the window) serves the example's side only; a length past the window is
    # profiled at that length, where the fit would have been wrong.
    config = transformers.MistralConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=_VOCAB, sliding_window=80, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.MistralForCausalLM(config)
    profile = profile_model(model, inputs=_tokens(2))
    assert profile.seq_window == 80
    fp32 = profile.precisions[0]
    for seq in (40, 120):
        at_length = profile_model(model, inputs=_tokens(2, seq))
        assert profile.estimate(3, seq_len=seq).peak_bytes == at_length.estimate(3).peak_bytes
    fitted = profile.timeline(fp32, Mode.TRAIN, 40)
    assert fitted.seq_degree == 2  # below the window: the fit
    assert profile.timeline(fp32, Mode.TRAIN, 120).seq_degree == 0  # past it: that length
    # the fit's steps at 120 tokens are not the step there (the mask it does not have)
    real = profile_model(model, inputs=_tokens(2, 120)).timeline(fp32, Mode.TRAIN)
    assert len(real.event_module) != len(fitted.event_module) or not np.array_equal(
        real.events_at(3), fitted.events_at(3, 120)
    )


def test_batch_one_takes_its_own_path() -> None:
    # GPT-2's eager attention trains at batch 1 with one more copy of its scores than the
    # line through batches 2 and 3 says (-65,536 B at 64 tokens, -1.2 % to -1.5 % at 64-512
    # tokens, when batch 1 was not run): batch 1 is profiled as it is.
    model = _build("gpt2")
    model.config._attn_implementation = "eager"
    profile = profile_model(model, inputs=_tokens(2, 48), device="cpu")
    assert profile.timeline(profile.precisions[0], Mode.TRAIN).batch_one is not None
    for batch in (1, 2):
        est = profile.estimate(batch, "fp32", "adam")
        real = measure(model, _tokens(batch, 48), optimizer="adam")
        _assert_to_the_byte(est.peak_bytes, real.peak_bytes, batch)
    # and at other lengths: batch 1 is fitted in the length apart from the others
    for batch in (1, 3):
        est = profile.estimate(batch, "fp32", "adam", seq_len=20)
        real = measure(model, _tokens(batch, 20), optimizer="adam")
        _assert_to_the_byte(est.peak_bytes, real.peak_bytes, batch)
    fitted = profile.timeline(profile.precisions[0], Mode.TRAIN, 20)
    assert fitted.seq_degree == 2 and fitted.batch_one is not None
    assert fitted.batch_one.seq_degree == 2


_HEADS = {"gpt2": "transformer.ln_f.*", "bert": "classifier.*", "llama": "lm_head.*",
          "t5": "decoder.final_layer_norm.*", "vit": "classifier.*"}  # fmt: skip


# slow (left to the first CI pass): T5 and ViT, whose levers take the longest; the
# narrowed-ISA pass keeps the decoder and encoder ones (GPT-2, Llama, BERT)
@pytest.mark.parametrize(
    "name",
    [
        n if n not in ("t5", "vit") else pytest.param(n, marks=pytest.mark.slow)
        for n in sorted(_MODELS)
    ],
)
def test_levers_estimate_equals_hugging_face_applying_them(name: str) -> None:
    # From the plain model's profile: checkpoint="auto" against Hugging Face's own
    # activation_checkpointing_enable (non-reentrant) on the measured copy, a frozen backbone
    # (only the head trains) against requires_grad_(False), and 3 accumulated micro-batches;
    # at batch 1 and 8, to the byte.
    model = _build(name)
    make = _MODELS[name][1]
    before = snapshot_model(model)
    profile = profile_model(model, inputs=make(2), device="cpu")
    assert profile.hf_checkpointing and len(profile.checkpoint_blocks) >= 2
    for levers in (
        {"checkpoint": "auto"},
        {"trainable": _HEADS[name]},
        {"grad_accumulation": 3},
    ):
        for batch in (1, 8):
            est = profile.estimate(batch, "fp32", "adamw", **levers)
            real = measure(model, make(batch), optimizer="adamw", **levers)
            _assert_to_the_byte(est.peak_bytes, real.peak_bytes, levers, batch)
    assert_model_unchanged(model, before)
    assert not getattr(model, "gradient_checkpointing", False)
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


# slow: T5, left to the first CI pass (the narrowed-ISA pass keeps GPT-2, Llama and BERT)
@pytest.mark.parametrize(
    "name", ["gpt2", "llama", "bert", pytest.param("t5", marks=pytest.mark.slow)]
)
def test_lora_estimate_equals_peft_applying_it(name: str) -> None:
    # PEFT's get_peft_model with its default targets for the architecture (c_attn; q_proj and
    # v_proj; query and value; q and v), on measure()'s copy, against the estimate from the
    # plain profile; alone (fp32 and bf16) and with Hugging Face's checkpointing: to the byte
    # (each adapter's scaling number, kept by its MulBackward0, included).
    pytest.importorskip("peft")
    model = _build(name)
    make = _MODELS[name][1]
    before = snapshot_model(model)
    profile = profile_model(model, inputs=make(2), device="cpu")
    # in bf16 PEFT keeps the adapters in fp32 on the bf16 base (autocast_adapter_dtype)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"lora_rank": 8}, "fp32"),
        ({"lora_rank": 8}, "bf16"),
        ({"lora_rank": 4, "checkpoint": "auto"}, "fp32"),
    ]
    for levers, precision in cases:
        for batch in (1, 8):
            est = profile.estimate(batch, precision, "adamw", **levers)
            real = measure(model, make(batch), optimizer="adamw", precision=precision, **levers)
            adapters = sum(n.endswith(".lora_A.default") for n in est.layers.name)
            assert adapters >= 2
            _assert_to_the_byte(est.peak_bytes, real.peak_bytes, levers, precision, batch)
    assert_model_unchanged(model, before)
    assert type(model).__name__ == type(_build(name)).__name__  # not wrapped by PEFT
