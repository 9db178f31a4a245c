"""Tests for vram_widget.zoo: exact architectures, registry contract, weight tying, meta builds."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from vram_widget.zoo import (
    LLAMA_7B,
    LLAMA_70B,
    LLAMA_TINY,
    ZOO,
    LlamaConfig,
    SequenceClassifierOutput,
    alexnet,
    causal_decoder,
    llama_decoder,
    llama_param_count,
    mobilenet_v2,
    resnet18,
    resnet50,
    tied_autoencoder,
    vgg16,
    zoo_model,
)
from vram_widget.zoo.llama import RMSNorm


def _param_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _batch_dim(output: Any) -> int:
    if isinstance(output, SequenceClassifierOutput):
        return int(output.logits.shape[0])
    assert isinstance(output, torch.Tensor), type(output)
    return int(output.shape[0])


def _call(model: torch.nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)


def _flatten(inputs: Any) -> list[torch.Tensor]:
    if isinstance(inputs, dict):
        return list(inputs.values())
    if isinstance(inputs, tuple):
        return list(inputs)
    return [inputs]


# Expected counts: torchvision's model documentation ("Params" in each weights table, e.g.
# VGG16_Weights.IMAGENET1K_V1, ResNet50_Weights.IMAGENET1K_V1), which is
# sum(p.numel() for p in model.parameters()) of torchvision.models.<name>() at 1000 classes.
# Built on the meta device: the count is the same and nothing is allocated.
@pytest.mark.parametrize(
    ("factory", "expected"),
    [
        (vgg16, 138_357_544),
        (alexnet, 61_100_840),
        (resnet18, 11_689_512),
        (resnet50, 25_557_032),
        (mobilenet_v2, 3_504_872),
    ],
    ids=["vgg16", "alexnet", "resnet18", "resnet50", "mobilenet_v2"],
)
def test_vision_parameter_counts_match_torchvision(factory: Any, expected: int) -> None:
    with torch.device("meta"):
        model = factory()
    assert _param_count(model) == expected


def test_vision_module_names_match_torchvision() -> None:
    # A sample of torchvision's state_dict keys, so checkpoints and per-module reports line up.
    expected = {
        vgg16: [
            "features.0.weight",
            "features.28.bias",
            "classifier.0.weight",
            "classifier.6.bias",
        ],
        alexnet: [
            "features.0.weight",
            "features.10.weight",
            "classifier.1.weight",
            "classifier.6.bias",
        ],
        resnet18: ["conv1.weight", "bn1.running_mean", "layer2.0.downsample.0.weight", "fc.bias"],
        resnet50: ["layer1.0.conv3.weight", "layer4.2.bn3.num_batches_tracked", "fc.weight"],
        mobilenet_v2: [
            "features.0.0.weight",
            "features.1.conv.0.0.weight",
            "features.17.conv.2.weight",
            "features.18.1.bias",
            "classifier.1.weight",
        ],
    }
    for factory, names in expected.items():
        with torch.device("meta"):
            keys = set(factory().state_dict())
        missing = [name for name in names if name not in keys]
        assert not missing, (factory.__name__, missing)


def test_alexnet_minimum_image_size_is_63() -> None:
    with torch.device("meta"):
        model = alexnet()
        assert model(torch.empty(1, 3, 63, 63)).shape == (1, 1000)
        with pytest.raises(RuntimeError):
            model(torch.empty(1, 3, 62, 62))


def test_vgg16_accepts_32px_images() -> None:
    with torch.device("meta"):
        assert vgg16()(torch.empty(2, 3, 32, 32)).shape == (2, 1000)


def test_zoo_names_match_entries() -> None:
    assert all(name == entry.name for name, entry in ZOO.items())
    expected = {
        "vgg16", "alexnet", "resnet18", "resnet50", "mobilenet_v2", "mlp", "transformer_encoder",
        "causal_decoder", "lstm", "embedding_heavy", "tied_autoencoder", "llama_tiny",
        "dict_input",
    }  # fmt: skip
    assert set(ZOO) == expected
    assert all(entry.description for entry in ZOO.values())


@pytest.mark.parametrize("name", list(ZOO))
def test_entry_builds_and_runs_forward_at_batch_2(name: str) -> None:
    entry = ZOO[name]
    torch.manual_seed(0)
    model = entry.build()
    inputs = entry.make_inputs(2)
    assert all(t.shape[0] == 2 for t in _flatten(inputs) if t.dim() > 0)
    with torch.no_grad():
        output = _call(model, inputs)
    assert _batch_dim(output) == 2


# vgg16/alexnet/resnet50 are left out only to keep the file fast; their forward runs above.
@pytest.mark.parametrize("name", [n for n in ZOO if n not in {"vgg16", "alexnet", "resnet50"}])
def test_entry_trains_every_parameter(name: str) -> None:
    entry = ZOO[name]
    torch.manual_seed(0)
    model = entry.build()
    output = _call(model, entry.make_inputs(2))
    loss = output.loss if isinstance(output, SequenceClassifierOutput) else output.float().mean()
    assert loss is not None
    loss.backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None]
    assert not no_grad, no_grad


@pytest.mark.parametrize("name", list(ZOO))
def test_make_inputs_is_deterministic_and_leaves_global_rng_alone(name: str) -> None:
    entry = ZOO[name]
    torch.manual_seed(1234)
    state = torch.random.get_rng_state()
    first = _flatten(entry.make_inputs(3))
    second = _flatten(entry.make_inputs(3))
    assert torch.equal(torch.random.get_rng_state(), state)
    assert len(first) == len(second)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert all(t.device.type == "cpu" for t in first)


def test_make_inputs_ignore_the_default_device() -> None:
    # Inputs are always real CPU tensors, even if the caller builds models under a device
    # context (the generator lives on the CPU).
    entry = ZOO["mlp"]
    with torch.device("meta"):
        x = entry.make_inputs(2)
    assert x.device.type == "cpu"


def test_dict_input_entry_is_hugging_face_style() -> None:
    entry = zoo_model("dict_input")
    inputs = entry.make_inputs(8)
    assert set(inputs) == {"input_ids", "attention_mask", "labels"}
    assert inputs["input_ids"].dtype == torch.long
    mask = inputs["attention_mask"]
    assert mask.shape == inputs["input_ids"].shape
    assert bool((mask.sum(dim=1) >= 1).all())
    assert bool((mask == 0).any()), "some rows should be padded"
    output = entry.build()(**inputs)
    assert dataclasses.is_dataclass(output)
    assert output.logits.shape == (8, 4)
    assert output.loss is not None and output.loss.dim() == 0
    no_labels = {k: v for k, v in inputs.items() if k != "labels"}
    assert entry.build()(**no_labels).loss is None


def test_causal_decoder_ties_embedding_and_head() -> None:
    model = causal_decoder()
    assert model.lm_head.weight is model.tok_emb.weight
    assert model.lm_head.weight.data_ptr() == model.tok_emb.weight.data_ptr()
    all_names = dict(model.named_parameters(remove_duplicate=False))
    assert len(list(model.parameters())) == len(all_names) - 1
    untied = causal_decoder(tie_weights=False)
    assert _param_count(untied) - _param_count(model) == 1000 * 128
    # The shared weight's gradient collects both uses (embedding lookup and LM head).
    model(torch.zeros(2, 8, dtype=torch.long)).float().mean().backward()
    assert model.tok_emb.weight.grad is not None
    assert bool(model.tok_emb.weight.grad[1:].abs().sum() > 0), "head gradient reaches all rows"


def test_tied_autoencoder_shares_one_weight() -> None:
    model = tied_autoencoder()
    params = list(model.parameters())
    assert len(params) == 3  # encoder.weight, encoder.bias, decoder_bias
    assert _param_count(model) == 784 * 128 + 128 + 784
    weight = model.encoder.weight
    assert weight.t().data_ptr() == weight.data_ptr()

    # The tied gradient is the sum of the two uses' gradients.
    x = ZOO["tied_autoencoder"].make_inputs(4)
    model(x).pow(2).mean().backward()
    assert weight.grad is not None
    enc_w = weight.detach().clone().requires_grad_()
    dec_w = weight.detach().t().clone().requires_grad_()
    h = torch.relu(F.linear(x, enc_w, model.encoder.bias.detach()))
    F.linear(h, dec_w, model.decoder_bias.detach()).pow(2).mean().backward()
    assert enc_w.grad is not None and dec_w.grad is not None
    torch.testing.assert_close(weight.grad, enc_w.grad + dec_w.grad.t())


def test_llama_tied_config_shares_weight_and_counts_it_once() -> None:
    config = dataclasses.replace(LLAMA_TINY, tie_weights=True)
    model = llama_decoder(config)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    assert _param_count(model) == llama_param_count(config)
    assert llama_param_count(LLAMA_TINY) - llama_param_count(config) == 1000 * 128


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        # Llama-2-7B: 6,738,415,616, the parameter count of meta-llama/Llama-2-7b-hf.
        (LLAMA_7B, 6_738_415_616),
        # Llama-2-70B's shape: the closed form below (Meta reports "70B"; HF's count agrees).
        (LLAMA_70B, 68_976_648_192),
        (LLAMA_TINY, None),
    ],
    ids=["7b", "70b", "tiny"],
)
def test_llama_builds_on_meta_and_matches_closed_form(
    config: LlamaConfig, expected: int | None
) -> None:
    with torch.device("meta"):
        model = llama_decoder(config)
    tensors = [*model.parameters(), *model.buffers()]
    assert all(t.is_meta for t in tensors), "a meta build must allocate nothing"
    assert _param_count(model) == llama_param_count(config)
    if expected is not None:
        assert llama_param_count(config) == expected


def test_llama_7b_forward_runs_on_meta() -> None:
    with torch.device("meta"):
        model = llama_decoder(LLAMA_7B)
        logits = model(torch.zeros(1, 16, dtype=torch.long))
    assert logits.shape == (1, 16, 32000)
    assert logits.is_meta


@pytest.mark.parametrize("name", ["causal_decoder", "llama_tiny"])
def test_decoders_are_causal(name: str) -> None:
    torch.manual_seed(0)
    model = ZOO[name].build().eval()
    ids = ZOO[name].make_inputs(2)
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 1000
    with torch.no_grad():
        a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :-1], b[:, :-1])
    assert not torch.allclose(a[:, -1], b[:, -1])


def test_llama_gqa_uses_fewer_kv_parameters() -> None:
    model = llama_decoder(LLAMA_TINY)
    attn = model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (128, 128)
    assert attn.k_proj.weight.shape == (2 * 32, 128)  # n_kv_head * head_dim
    assert all(m.bias is None for m in model.modules() if isinstance(m, torch.nn.Linear)), (
        "Llama projections have no biases"
    )


def test_llama_rejects_overlong_input() -> None:
    with pytest.raises(ValueError, match="max_len"):
        llama_decoder(LLAMA_TINY)(torch.zeros(1, LLAMA_TINY.max_len + 1, dtype=torch.long))


def test_rmsnorm_matches_torch() -> None:
    norm = RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(4, 7, 16, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(norm(x), F.rms_norm(x, (16,), norm.weight, eps=1e-5))


def test_llama_config_is_frozen_and_validated() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        LLAMA_7B.d_model = 1  # type: ignore[misc]
    with pytest.raises(ValueError, match="n_kv_head"):
        LlamaConfig(1000, 128, 2, 4, 3, 344, 128)
    with pytest.raises(ValueError, match="n_head"):
        LlamaConfig(1000, 130, 2, 4, 4, 344, 128)


def test_zoo_model_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        ZOO["mlp"].name = "other"  # type: ignore[misc]


def test_zoo_model_lookup() -> None:
    assert zoo_model("resnet18") is ZOO["resnet18"]
    with pytest.raises(KeyError) as info:
        zoo_model("nope")
    message = str(info.value)
    assert "'nope'" in message
    assert all(name in message for name in ZOO)
