"""Models named by a string (vram_widget._profiling.hub): a local directory holding a
config.json profiles as the same model built by hand; the class built is the one
config.architectures names; every failure to read a config says what to do; nothing here
touches the network (HF_HUB_OFFLINE=1, and the Hub's errors are raised by a patched
AutoConfig.from_pretrained, constructed as huggingface_hub constructs them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
httpx2 = pytest.importorskip("httpx2")  # what huggingface_hub builds its HTTP errors from

from huggingface_hub import constants as hub_constants  # noqa: E402
from huggingface_hub.errors import (  # noqa: E402
    GatedRepoError,
    LocalEntryNotFoundError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
)

from vram_widget import profile_model  # noqa: E402
from vram_widget._display.cli import main  # noqa: E402
from vram_widget._profiling import hub  # noqa: E402
from vram_widget._profiling.disk_cache import cache_directory  # noqa: E402

# The small GPT-2 of these tests: one block, 32 wide, 100 tokens, 64 positions.
_GPT2 = dict(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=64,
             bos_token_id=0, eos_token_id=0)  # fmt: skip
_LLAMA = dict(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
              num_key_value_heads=2, intermediate_size=64, vocab_size=100,
              max_position_embeddings=2048, bos_token_id=0, eos_token_id=0,
              pad_token_id=0)  # fmt: skip


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads the variable once, at import: set what it read, too
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)


def _saved(path: Path, config: Any) -> str:
    config.save_pretrained(path)
    return str(path)


def _gpt2_dir(path: Path) -> str:
    return _saved(path, transformers.GPT2Config(**_GPT2, architectures=["GPT2LMHeadModel"]))


def _raising(monkeypatch: pytest.MonkeyPatch, error: BaseException) -> None:
    def from_pretrained(*args: Any, **kwargs: Any) -> Any:
        raise error

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", from_pretrained)


def _response(status: int, url: str, code: str | None = None) -> Any:
    headers = {"X-Error-Code": code} if code else {}
    return httpx2.Response(status, request=httpx2.Request("GET", url), headers=headers)


_URL = "https://huggingface.co/org/name/resolve/main/config.json"


# --- building ---------------------------------------------------------------------------------


def test_directory_profiles_as_the_model_built_by_hand(tmp_path: Path) -> None:
    folder = _gpt2_dir(tmp_path)
    named = profile_model(folder, device="cpu", seq_len=16)
    assert named.model_name == f"{folder}: GPT2LMHeadModel (config.architectures)"
    assert named.seq_len == 16
    # wte 100*32 + wpe 64*32 + ln_1 2*32 + c_attn 32*96+96 + attn c_proj 32*32+32 + ln_2 2*32
    # + c_fc 32*128+128 + mlp c_proj 128*32+32 + ln_f 2*32 (lm_head tied to wte: once)
    # = 3200 + 2048 + 64 + 3168 + 1056 + 64 + 4224 + 4128 + 64 = 18016
    assert named.param_count == 18016
    config = transformers.GPT2Config(**_GPT2)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    ids = torch.zeros(1, 16, dtype=torch.long)
    by_hand = profile_model(model, inputs={"input_ids": ids, "labels": ids}, device="cpu")
    for batch in (1, 8):
        assert named.estimate(batch).peak_bytes == by_hand.estimate(batch).peak_bytes
        assert named.estimate(batch).flops == by_hand.estimate(batch).flops


def test_default_length_is_bounded_by_the_position_table(tmp_path: Path) -> None:
    # 64 positions < the default 128: the example is 64 tokens
    built = hub.hub_model(_gpt2_dir(tmp_path))
    assert built.inputs["input_ids"].shape == (1, 64)
    llama = _saved(tmp_path / "llama", transformers.LlamaConfig(**_LLAMA))
    assert hub.hub_model(llama).inputs["input_ids"].shape == (1, hub.DEFAULT_SEQ_LEN)


def test_without_architectures_the_auto_classes_build(tmp_path: Path) -> None:
    llama = hub.hub_model(_saved(tmp_path / "l", transformers.LlamaConfig(**_LLAMA)))
    assert llama.label.endswith(": LlamaForCausalLM (AutoModelForCausalLM)")
    assert sorted(llama.inputs) == ["input_ids", "labels"]
    assert all(p.device.type == "meta" for p in llama.model.parameters())
    encoder_config = transformers.DistilBertConfig(
        n_layers=1, dim=32, n_heads=2, hidden_dim=64, vocab_size=100
    )
    encoder = hub.hub_model(_saved(tmp_path / "d", encoder_config))
    # DistilBERT has no causal-LM head (not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES): bare model
    assert encoder.label.endswith(": DistilBertModel (AutoModel)")
    assert sorted(encoder.inputs) == ["input_ids"]


def test_a_classification_head_gets_no_token_labels(tmp_path: Path) -> None:
    # its labels are one class per sample, not per token: the loss is the logits' mean
    config = transformers.BertConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
        vocab_size=100, architectures=["BertForSequenceClassification"],
    )  # fmt: skip
    built = hub.hub_model(_saved(tmp_path, config), seq_len=8)
    assert type(built.model).__name__ == "BertForSequenceClassification"
    assert sorted(built.inputs) == ["input_ids"]
    masked = transformers.BertConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
        vocab_size=100, architectures=["BertForMaskedLM"],
    )  # fmt: skip
    assert sorted(hub.hub_model(_saved(tmp_path / "m", masked)).inputs) == ["input_ids", "labels"]


def test_encoder_decoder_and_vision_models_are_refused_by_name(tmp_path: Path) -> None:
    t5 = transformers.T5Config(
        num_layers=1, d_model=32, num_heads=2, d_ff=64, d_kv=16, vocab_size=100,
        architectures=["T5ForConditionalGeneration"],
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"T5ForConditionalGeneration\) is an encoder-decoder"):
        hub.hub_model(_saved(tmp_path / "t5", t5))
    vit = transformers.ViTConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
        architectures=["ViTForImageClassification"],
    )  # fmt: skip
    with pytest.raises(ValueError, match="ViTForImageClassification, whose forward takes no"):
        hub.hub_model(_saved(tmp_path / "vit", vit))


# --- keywords that do not go together --------------------------------------------------------


def test_string_model_refuses_input_size_and_inputs(tmp_path: Path) -> None:
    folder = _gpt2_dir(tmp_path)
    with pytest.raises(ValueError, match=r"input_size= does not go with .* give seq_len=N"):
        profile_model(folder, input_size=(16,))
    ids = torch.zeros(1, 16, dtype=torch.long)
    with pytest.raises(ValueError, match=r"inputs= does not go with"):
        profile_model(folder, inputs={"input_ids": ids})
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="seq_len must be a whole number of tokens >= 1"):
            profile_model(folder, seq_len=bad)


def test_module_refuses_string_keywords() -> None:
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"seq_len= is for a model named by a string"):
        profile_model(model, input_size=(4,), seq_len=16)
    with pytest.raises(ValueError, match=r"trust_remote_code= is for a model named by"):
        profile_model(model, input_size=(4,), trust_remote_code=True)


# --- names and configs that cannot be read ---------------------------------------------------


def test_bad_names_are_refused_before_any_network_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _raising(monkeypatch, AssertionError("AutoConfig.from_pretrained was called"))
    for name in ("a/b/c", "no such model", "-leading-dash", "x" * 97, str(tmp_path / "gone")):
        with pytest.raises(ValueError, match="is neither an existing directory nor a Hub id"):
            profile_model(name)
    with pytest.raises(ValueError, match=r"holds no config\.json"):
        profile_model(str(tmp_path))  # a directory, empty


def test_gated_repository(monkeypatch: pytest.MonkeyPatch) -> None:
    # hf_raise_for_status: X-Error-Code GatedRepo on a 401/403 -> GatedRepoError, which
    # transformers' cached_file re-raises as an OSError ``from`` it
    gated = GatedRepoError(
        f"401 Client Error.\n\nCannot access gated repo for url {_URL}.",
        response=_response(401, _URL, "GatedRepo"),
    )
    for error in (gated, _wrapped(gated)):
        _raising(monkeypatch, error)
        expected = r"gated: accept its licence on https://huggingface.co/org/name.*hf auth login"
        with pytest.raises(PermissionError, match=expected + r".*HF_TOKEN"):
            profile_model("org/name")


def _wrapped(error: BaseException) -> OSError:
    try:
        raise OSError("transformers' message") from error
    except OSError as wrapped:
        return wrapped


def test_missing_repository(monkeypatch: pytest.MonkeyPatch) -> None:
    missing = RepositoryNotFoundError(
        f"401 Client Error.\n\nRepository Not Found for url: {_URL}.",
        response=_response(401, _URL, "RepoNotFound"),
    )
    for error in (missing, _wrapped(missing)):
        _raising(monkeypatch, error)
        with pytest.raises(OSError, match=r"no model 'org/name' on the Hugging Face Hub: check "
                           r"the id.*local directory"):  # fmt: skip
            profile_model("org/name")


def test_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    offline = LocalEntryNotFoundError(
        "Cannot find the requested files in the disk cache and outgoing traffic has been "
        "disabled. To enable hf.co look-ups and downloads online, set 'local_files_only' to False."
    )
    _raising(monkeypatch, offline)
    with pytest.raises(ConnectionError, match=r"no network .* not in the Hugging Face cache"):
        profile_model("org/name")
    monkeypatch.undo()  # the real AutoConfig, still offline: transformers wraps the same error
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConnectionError, match=r"cannot fetch the config\.json of 'org/not-cached'"):
        profile_model("org/not-cached")


def test_repository_without_config(monkeypatch: pytest.MonkeyPatch) -> None:
    absent = RemoteEntryNotFoundError(
        f"404 Client Error.\n\nEntry Not Found for url: {_URL}.",
        response=_response(404, _URL, "EntryNotFound"),
    )
    _raising(monkeypatch, absent)
    with pytest.raises(ValueError, match=r"'org/name' has no config\.json: it is not a "
                       r"transformers model repository"):  # fmt: skip
        profile_model("org/name")


def test_config_of_no_known_model_type(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "no-such-type", "hidden_size": 8}')
    with pytest.raises(ValueError, match=r"names no model type this transformers"):
        profile_model(str(tmp_path))
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    with pytest.raises(ValueError, match=r"names no model type this transformers"):
        profile_model(str(tmp_path))


def test_remote_code_needs_trust_remote_code(tmp_path: Path) -> None:
    # a known model type whose architecture is the repository's own class
    config = transformers.LlamaConfig(
        **_LLAMA, architectures=["MyLlamaForCausalLM"],
        auto_map={"AutoModelForCausalLM": "modeling_my.MyLlamaForCausalLM"},
    )  # fmt: skip
    folder = _saved(tmp_path / "arch", config)
    with pytest.raises(ValueError, match=r"needs trust_remote_code=True .*MyLlamaForCausalLM is "
                       r"not in transformers.*runs that code"):  # fmt: skip
        profile_model(folder)
    # a model type only the repository's code defines: AutoConfig itself refuses
    (tmp_path / "type").mkdir()
    (tmp_path / "type" / "config.json").write_text(
        '{"model_type": "my-type", "auto_map": {"AutoConfig": "configuration_my.MyConfig"}}'
    )
    with pytest.raises(ValueError, match=r"needs trust_remote_code=True \(--trust-remote-code\)"):
        profile_model(str(tmp_path / "type"))


# --- the disk cache ---------------------------------------------------------------------------


def test_disk_cache_hits_on_the_second_profile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vram_widget._profiling.profiler import _Source

    runs: list[str] = []
    original = _Source.timeline

    def counted(source: _Source, *args: Any, **kwargs: Any) -> Any:
        runs.append("timeline")
        return original(source, *args, **kwargs)

    monkeypatch.setattr(_Source, "timeline", counted)
    folder = _gpt2_dir(tmp_path / "model")
    cache = tmp_path / "cache"
    # fp32 profiled up front (by default the runs wait for the first estimate)
    eager = {"device": "cpu", "cache": cache, "precisions": ("fp32",)}
    first = profile_model(folder, seq_len=16, **eager)
    assert runs and cache_directory(cache) == cache and any(cache.iterdir())
    runs.clear()
    second = profile_model(folder, seq_len=16, **eager)
    assert runs == []  # every timeline read from the cache
    assert second.estimate(4).peak_bytes == first.estimate(4).peak_bytes
    profile_model(folder, seq_len=32, **eager)
    assert runs  # another length: another key


# --- the command line ------------------------------------------------------------------------


def test_cli_hf_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _gpt2_dir(tmp_path)
    argv = ["--hf", folder, "--seq-len", "16", "--device", "cpu", "--precision", "fp32",
            "--batch-size", "4"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"built from the config.json of {folder} (no weights): GPT2LMHeadModel" in out
    assert "input_ids: 16 int64, labels: 16 int64" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--hf", "a/b/c"], "is neither an existing directory nor a Hub id"),
        (["--trust-remote-code", "mlp"], "--trust-remote-code goes with --hf"),
        (["--hf", "org/name", "--transformers", "gpt2"], "give one model"),
        (["--hf", "org/name", "--input-size", "16"], "--input-size does not go with --hf"),
        (["--hf", "org/name", "--config", "n_layer=1"], "--hf ID reads its config.json"),
        (["--hf", "org/not-cached"], "cannot fetch the config.json of 'org/not-cached'"),
    ],
)
def test_cli_hf_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


# --- the widget ------------------------------------------------------------------------------


def test_show_memory_takes_a_name(tmp_path: Path) -> None:
    from vram_widget import show_memory

    w = show_memory(_gpt2_dir(tmp_path), device="cpu", seq_len=16, batch_size=4)
    assert w.estimate.batch_size == 4
    assert "GPT2LMHeadModel (config.architectures)" in w._profile.model_name
    assert w._profile.seq_len == 16  # profiled at the slider's starting length
    with pytest.raises(ValueError, match=r"trust_remote_code= is for a model named by"):
        show_memory(torch.nn.Linear(4, 4), input_size=(4,), trust_remote_code=True)
