"""Tests for the command line (vram_widget._display.cli): real numbers against the Python API, and
every bad value a usage error (exit code 2) that names the valid forms, never a traceback.

Small models only: the zoo's ``mlp`` on --device cpu, a tiny callable written to a module
under tmp_path (tests/ is not a package, so ``tests.test_cli:...`` would not import), and a
one-layer GPT-2 built from a config (no download).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from models import assert_model_unchanged, snapshot_model

from vram_widget import profile_model, zoo
from vram_widget._display.cli import _bytes, main
from vram_widget._estimating.gpus import resolve_gpu

_MODULE = "vram_cli_models"
_GPT2 = [
    "--transformers",
    "gpt2",
    "--config",
    # bos/eos inside the 64-token vocabulary: transformers warns of its default 50256 otherwise
    "n_layer=1,n_embd=32,n_head=2,vocab_size=64,n_positions=64,bos_token_id=0,eos_token_id=0",
    "--seq-len",
    "16",
]
# generation with transformers' quantized KV cache
_KV_GENERATE = ["--mode", "generate", "--kv-cache", "quantized"]


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A module ``vram_cli_models`` on sys.path with the callables the tests name."""
    (tmp_path / f"{_MODULE}.py").write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn

            # The same instance every call, so a test can check the CLI left it as it was.
            MODEL = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
            MODEL.eval()

            def tiny_model():
                return MODEL

            def not_a_module():
                return {"weights": torch.zeros(3)}

            def broken():
                raise RuntimeError("no such checkpoint")
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop(_MODULE, None)
    yield __import__(_MODULE)
    sys.modules.pop(_MODULE, None)


def _run_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: vram-widget" in err
    assert "Traceback" not in err
    return err


# --- results --------------------------------------------------------------------------------


def test_json_matches_python_api(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run_json(
        ["mlp", "--device", "cpu", "--batch-size", "64", "--gpu", "24GiB",
         "--precision", "fp32", "--precision", "bf16,amp-bf16", "--optimizer", "sgd"],
        capsys,
    )  # fmt: skip
    entry = zoo.ZOO["mlp"]
    profile = profile_model(entry.build(), inputs=entry.make_inputs(2), device="cpu")
    assert out["model"] == "mlp"
    assert out["input_shape"] == profile.input_shape == "batch × 784"
    assert out["device"] == "cpu"
    assert out["gpu"] == {"name": "custom 24 GiB", "memory_bytes": 24 * 2**30}
    assert out["peak_bytes_means"].startswith("allocated: the peak of allocated bytes on the CPU")
    assert [s["precision"] for s in out["settings"]] == ["fp32", "bf16", "amp-bf16"]
    for setting in out["settings"]:
        est = profile.estimate(64, setting["precision"], "sgd", "train")
        assert setting["batch_size"] == 64
        assert (setting["optimizer"], setting["mode"]) == ("sgd", "train")
        assert setting["peak_bytes"] == est.peak_bytes > 0
        assert setting["extras_bytes"] == est.extras.total_bytes == 0  # nothing extra on cpu
        assert setting["total_bytes"] == est.total_bytes
        assert setting["peak_phase"] == est.peak_phase.value
        assert setting["peak_module"] == est.peak_module
        assert setting["flops"] == est.flops > 0
        assert setting["fit_bytes"] == est.peak_bytes  # on the CPU: allocated, no extras
        assert setting["fits"] is est.fits(24 * 2**30) is True
        largest = profile.max_batch_size(24 * 2**30, setting["precision"], "sgd", "train")
        assert setting["max_batch_size"] == largest > 64


def test_text_output_states_settings_and_fit(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "mlp", "--device", "cpu", "--batch-size", "64", "--gpu", "24GiB",
                 "--precision", "fp32"]) == 0  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    entry = zoo.ZOO["mlp"]
    profile = profile_model(entry.build(), inputs=entry.make_inputs(2), device="cpu")
    assert lines[0] == repr(profile)
    assert "inputs: batch × 784" in lines[0]
    text = "\n".join(lines)
    assert "allocated = the peak of allocated bytes on the CPU" in text
    assert "torch.cuda" not in text  # --device cpu speaks of the CPU
    row = next(line for line in lines if line.split()[:4] == ["64", "fp32", "adam", "train"])
    est = profile.estimate(64, "fp32", "adam", "train")
    assert est.peak_location in row
    (fit,) = [line for line in lines if "fits on" in line]
    largest = profile.max_batch_size(24 * 2**30, "fp32", "adam", "train")
    assert fit.startswith("fp32:")
    assert "fits on custom 24 GiB (24.0 GiB) at batch 64: yes," in fit
    assert fit.endswith(f"largest batch that fits: {largest:,}")
    assert "per-layer table" not in text  # only with --layers


def test_fit_line_says_no_when_it_does_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    # 16 MiB holds the mlp's weights, gradients and Adam state (10.7 MB) at a few hundred samples.
    out = _run_json(["mlp", "--device", "cpu", "--batch-size", "4096", "--gpu", "16MiB",
                     "--precision", "fp32"], capsys)  # fmt: skip
    (setting,) = out["settings"]
    assert setting["fits"] is False
    assert setting["total_bytes"] > 16 * 2**20
    assert main(["mlp", "--device", "cpu", "--batch-size", "4096", "--gpu", "16MiB",
                 "--precision", "fp32"]) == 0  # fmt: skip
    fit = next(line for line in capsys.readouterr().out.splitlines() if "fits on" in line)
    assert f": no, allocated {_bytes(setting['peak_bytes'])} of 16 MiB" in fit
    largest = setting["max_batch_size"]
    assert fit.endswith(
        f"largest batch that fits: {largest:,}" if largest else "not even batch 1 fits"
    )


def test_gpu_catalog_name_and_cuda_extras(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run_json(["mlp", "--gpu", "a100 80gb", "--precision", "bf16", "--mode",
                     "inference"], capsys)  # fmt: skip
    a100 = resolve_gpu("A100 80GB")
    assert out["gpu"] == {"name": "A100 80GB", "memory_bytes": 80 * 2**30}
    entry = zoo.ZOO["mlp"]
    profile = profile_model(entry.build(), inputs=entry.make_inputs(2), device="cuda")
    est = profile.estimate(32, "bf16", None, "inference", compute_capability=(8, 0))
    (setting,) = out["settings"]
    assert setting["optimizer"] is None  # inference runs no optimizer
    assert setting["extras_bytes"] == est.extras.total_bytes > 0  # CUDA context and friends
    assert setting["total_bytes"] == est.total_bytes
    assert setting["max_batch_size"] == profile.max_batch_size(
        a100, "bf16", None, "inference", compute_capability=a100.compute_capability
    )


def test_layers_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["mlp", "--device", "cpu", "--precision", "bf16,fp32", "--layers"]) == 0
    out = capsys.readouterr().out
    assert "per-layer table (bf16, batch 32):" in out
    assert "param_count" in out


def test_callable_model(user_module: Any, capsys: pytest.CaptureFixture[str]) -> None:
    model = user_module.MODEL
    before = snapshot_model(model)
    out = _run_json([f"{_MODULE}:tiny_model", "--input-size", "8", "--device", "cpu",
                     "--precision", "fp32"], capsys)  # fmt: skip
    profile = profile_model(model, input_size=(8,), device="cpu")
    assert out["model"] == f"{_MODULE}:tiny_model"
    assert out["input_shape"] == "batch × 8"
    assert out["settings"][0]["peak_bytes"] == profile.estimate(32).peak_bytes
    # The CLI's profile left the user's model as it was (the suite's shared check).
    assert_model_unchanged(model, before)


@pytest.mark.parametrize(
    "bad",
    [
        ["--batch-size", "0"],
        ["--precision", "fp8"],
        ["--gpu", "80"],
        ["--input-size", "8,x"],
        ["--optimizer", "lion"],
    ],
)
def test_bad_values_leave_the_callable_model_alone(
    user_module: Any, capsys: pytest.CaptureFixture[str], bad: list[str]
) -> None:
    model = user_module.MODEL
    before = snapshot_model(model)
    _usage_error([f"{_MODULE}:tiny_model", "--input-size", "8", "--device", "cpu", *bad], capsys)
    assert_model_unchanged(model, before)


def _gpt2_model(transformers: Any) -> torch.nn.Module:
    """The model the ``_GPT2`` flags build, as the command line builds it (on meta)."""
    config = transformers.AutoConfig.for_model(
        "gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def test_transformers_model(capsys: pytest.CaptureFixture[str]) -> None:
    transformers = pytest.importorskip("transformers")
    out = _run_json([*_GPT2, "--device", "cpu", "--precision", "fp32", "--batch-size", "4"],
                    capsys)  # fmt: skip
    model = _gpt2_model(transformers)
    ids = torch.zeros(1, 16, dtype=torch.long)
    profile = profile_model(model, inputs={"input_ids": ids, "labels": ids}, device="cpu")
    assert out["model_class"] == "GPT2LMHeadModel"
    assert out["input_shape"] == profile.input_shape
    assert "batch × seq int64" in out["input_shape"]
    assert out["param_count"] == profile.param_count
    (setting,) = out["settings"]
    assert setting["peak_bytes"] == profile.estimate(4).peak_bytes
    assert setting["flops"] == profile.estimate(4).flops


def test_cpu_device_has_no_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    # in-process: the module entry (python -m vram_widget) runs in a fresh process in
    # test_a_transformers_model_prints_nothing_but_the_answer below
    out = _run_json(["mlp", "--device", "cpu", "--precision", "bf16"], capsys)
    assert out["settings"][0]["precision"] == "bf16"
    # --device cpu assumes no GPU: no capacity, so no verdict and no largest batch
    assert out["gpu"] is None
    assert (out["settings"][0]["fits"], out["settings"][0]["max_batch_size"]) == (None, None)


def test_a_transformers_model_prints_nothing_but_the_answer() -> None:
    # In a fresh process (a library logs its import-time messages once per process): what
    # transformers, torch and torchao log while the model is built and profiled is kept from
    # the user; stderr is empty and stdout is the answer.
    result = subprocess.run(
        [sys.executable, "-m", "vram_widget", "--transformers", "gpt2", "--config",
         "n_layer=1,n_embd=32,n_head=2,vocab_size=64,bos_token_id=0,eos_token_id=0",
         "--seq-len", "16", "--gpu", "A100 80GB"],
        capture_output=True, text=True, timeout=180, check=False,
        env={**os.environ, "VRAM_WIDGET_CACHE": "0"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout.startswith("ModelProfile(GPT2LMHeadModel")


def test_help_has_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert len(re.findall(r"^  vram-widget ", out, flags=re.MULTILINE)) == 4
    assert "--transformers" in out and ":build_model" in out and "--hf Qwen/" in out


def test_profiling_error_is_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    # The mlp takes 784 features; 3 × 4 samples fail in its first Linear.
    assert main(["mlp", "--device", "cpu", "--input-size", "3,4", "--precision", "fp32"]) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith("vram-widget: error: ")
    assert "Traceback" not in captured.err
    assert captured.out == ""


# --- usage errors: exit code 2, the valid forms named -----------------------------------------


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--batch-size", "0"], ">= 1"),
        (["--batch-size", "x"], ">= 1"),
        (["--precision", "fp8"], "'fp32', 'bf16', 'fp16', 'amp-bf16', 'amp-fp16'"),
        (["--precision", "fp32,fp8"], "'amp-bf16'"),
        (
            ["--optimizer", "lion"],
            "adamw-forloop, adamw8bit, paged-adamw8bit, adamw8bit-torchao, adamw4bit-torchao, "
            "adafactor, none",
        ),
        (["--mode", "eval"], "'train', 'inference'"),
        (["--device", "tpu"], "'cuda', 'cpu'"),
        (["--gpu", "80"], "below 1 MiB"),
        (["--gpu", "TPU v5"], "'80GiB'"),
        (["--input-size", "3,x"], "comma-separated positive integers"),
        (["--input-size", "0"], "comma-separated positive integers"),
        (["--seq-len", "0"], ">= 1"),
        (["resnet19"], "resnet18"),
        (["mlp", "--model", "mlp"], "not both"),
        (["mlp", "--config", "n_layer=1"], "--transformers"),
        (["mlp", "--device", "cpu", "--context-bytes", "1048576"], "--device cuda"),
        (["mlp", "--device", "cpu", "--lazy-loading", "false"], "--device cuda"),
    ],
)
def test_bad_values_are_usage_errors(
    argv: list[str], names: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _usage_error(argv, capsys)
    assert names in err
    if argv[0] == "--gpu":
        assert "a GPU name of the catalog" in err


def test_cuda_context_figure_and_its_source_are_shown(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from vram_widget._estimating.accelerator import cuda_context

    # an A100 (compute capability 8.0) with torch's lazy module loading: the table's row,
    # named with its source in the text and the JSON
    row = cuda_context((8, 0), lazy_loading=True)
    out = _run_json(["mlp", "--gpu", "A100 80GB", "--precision", "fp32"], capsys)
    (setting,) = out["settings"]
    assert (setting["cuda_context_bytes"], setting["cuda_context_source"]) == (
        row.nbytes,
        row.source,
    )
    assert main(["mlp", "--gpu", "A100 80GB", "--precision", "fp32"]) == 0
    text = capsys.readouterr().out
    assert f"CUDA context: {_bytes(row.nbytes)} in device ({row.source})" in text
    # a context measured by the user replaces it, and the device figure moves by the change
    given = _run_json(
        ["mlp", "--gpu", "A100 80GB", "--precision", "fp32", "--context-bytes", str(2**30)], capsys
    )
    (moved,) = given["settings"]
    assert moved["cuda_context_bytes"] == 2**30
    assert moved["cuda_context_source"] == f"given: context_bytes={2**30}"
    assert moved["device_bytes"] - setting["device_bytes"] == 2**30 - row.nbytes
    # without lazy loading, the eager figure of the table
    eager = _run_json(
        ["mlp", "--gpu", "A100 80GB", "--precision", "fp32", "--lazy-loading", "false"], capsys
    )
    assert eager["settings"][0]["cuda_context_bytes"] == cuda_context((8, 0), False).nbytes


def test_bad_config_pair(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    err = _usage_error(["--transformers", "gpt2", "--config", "n_layer"], capsys)
    assert "key=value,key=value" in err


def test_unknown_transformers_type(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    err = _usage_error(["--transformers", "not_a_model"], capsys)
    assert "unknown transformers model type 'not_a_model'" in err
    assert "gpt2, llama" in err


def test_transformers_config_the_model_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    err = _usage_error(["--transformers", "gpt2", "--config", "n_layer=abc"], capsys)
    assert "n_layer" in err


def test_missing_module(capsys: pytest.CaptureFixture[str]) -> None:
    err = _usage_error(["no_such_pkg_xyz.models:build", "--input-size", "8"], capsys)
    assert "cannot import module 'no_such_pkg_xyz.models'" in err
    assert "package.module:callable" in err


def test_missing_callable(user_module: Any, capsys: pytest.CaptureFixture[str]) -> None:
    err = _usage_error([f"{_MODULE}:no_such_fn", "--input-size", "8"], capsys)
    assert f"module {_MODULE!r} has no attribute 'no_such_fn'" in err
    assert "package.module:callable" in err


def test_callable_returning_non_module(
    user_module: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _usage_error([f"{_MODULE}:not_a_module", "--input-size", "8"], capsys)
    assert "returned a dict, not a torch.nn.Module" in err


def test_callable_that_raises(user_module: Any, capsys: pytest.CaptureFixture[str]) -> None:
    err = _usage_error([f"{_MODULE}:broken", "--input-size", "8"], capsys)
    assert "RuntimeError: no such checkpoint" in err


def test_callable_needs_input_size(user_module: Any, capsys: pytest.CaptureFixture[str]) -> None:
    err = _usage_error([f"{_MODULE}:tiny_model"], capsys)
    assert "--input-size is needed" in err
    assert "3,224,224" in err


def test_memory_lever_flags(capsys: pytest.CaptureFixture[str]) -> None:
    # the flags are estimate()'s lever keywords: the JSON's peak is estimate()'s with them
    argv = ["mlp", "--device", "cpu", "--batch-size", "8", "--precision", "fp32", "--json"]
    assert main([*argv, "--trainable", "6.*", "--grad-accumulation", "3"]) == 0
    out = json.loads(capsys.readouterr().out)["settings"][0]
    profile = profile_model(zoo.mlp(), input_size=(784,), device="cpu")
    expected = profile.estimate(8, "fp32", "adam", trainable=["6.*"], grad_accumulation=3)
    assert out["peak_bytes"] == expected.peak_bytes
    assert "3 micro-batches accumulated" in out["levers"]


def test_bad_lever_flag_is_an_error_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["mlp", "--device", "cpu", "--trainable", "nope.*"]) == 1
    assert "trainable pattern 'nope.*' matches no parameter" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["mlp", "--grad-accumulation", "0"])
    assert exit_info.value.code == 2


def test_data_parallel_flags(capsys: pytest.CaptureFixture[str]) -> None:
    # --gpus / --strategy are estimate()'s keywords: one rank's step, the worst ZeRO-1 rank
    argv = ["mlp", "--device", "cpu", "--batch-size", "8", "--precision", "fp32", "--json"]
    assert main([*argv, "--gpus", "4", "--strategy", "zero1"]) == 0
    out = json.loads(capsys.readouterr().out)["settings"][0]
    profile = profile_model(zoo.mlp(), input_size=(784,), device="cpu")
    expected = profile.estimate(8, "fp32", "adam", gpus=4, strategy="zero1")
    assert out["peak_bytes"] == expected.peak_bytes
    assert (out["gpus"], out["strategy"], out["rank"]) == (4, "zero1", expected.rank)
    assert out["communication_bytes"] == expected.communication_bytes > 0
    # --gpus-per-node / --fsdp-units: HSDP over nodes of 2; the units by class name
    argv_llama = ["llama_tiny", "--device", "cpu", "--batch-size", "2", "--precision", "fp32"]
    hsdp = ["--gpus", "4", "--strategy", "hsdp", "--gpus-per-node", "2", "--json"]
    assert main([*argv_llama, *hsdp, "--fsdp-units", "Linear,RMSNorm"]) == 0
    out = json.loads(capsys.readouterr().out)["settings"][0]
    entry = zoo.ZOO["llama_tiny"]
    llama = profile_model(entry.build(), inputs=entry.make_inputs(2), device="cpu")
    expected = llama.estimate(
        2, "fp32", "adam", gpus=4, strategy="hsdp", gpus_per_node=2,
        fsdp_units=["Linear", "RMSNorm"],
    )  # fmt: skip
    assert (out["peak_bytes"], out["strategy"]) == (expected.peak_bytes, "hsdp")
    err = _usage_error(["mlp", "--device", "cpu", "--gpus", "12", "--strategy", "hsdp"], capsys)
    assert "gpus=12 is not a whole number of nodes" in err


def test_tensor_parallel_flag(capsys: pytest.CaptureFixture[str]) -> None:
    # --tp is estimate()'s tp keyword with the model's own plan: one rank's step, in
    # training and in inference; a layout it does not divide is a usage error naming it
    pytest.importorskip("transformers")
    from models import hf_llama

    config = (
        "num_hidden_layers=2,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,"
        "intermediate_size=128,vocab_size=1000,bos_token_id=0,eos_token_id=0"
    )
    argv = ["--transformers", "llama", "--config", config, "--seq-len", "16", "--device",
            "cpu", "--batch-size", "2", "--precision", "fp32", "--json"]  # fmt: skip
    torch.manual_seed(0)
    ids = torch.zeros(1, 16, dtype=torch.long)  # the command line's example: ids as labels
    profile = profile_model(hf_llama(), inputs={"input_ids": ids, "labels": ids}, device="cpu")
    for mode in ("train", "inference"):
        assert main([*argv, "--mode", mode, "--gpus", "2", "--tp", "2"]) == 0
        out = json.loads(capsys.readouterr().out)["settings"][0]
        expected = profile.estimate(
            2, "fp32", "adam" if mode == "train" else None, mode=mode, gpus=2, tp=2
        )
        assert (out["peak_bytes"], out["gpus"], out["tp"]) == (expected.peak_bytes, 2, 2)
    err = _usage_error([*argv, "--tp", "2"], capsys)
    assert "--tp: tp=2 with gpus=1" in err
    # ddp and zero1 over tensor-parallel groups: refused as torchtitan refuses them, with
    # the strategies that are estimated; hsdp's node of part of a tp group too
    for strategy in ("ddp", "zero1"):
        err = _usage_error([*argv, "--gpus", "4", "--tp", "2", "--strategy", strategy], capsys)
        assert f"--tp: tp=2 on gpus=4 with strategy='{strategy}'" in err
        assert "'hsdp'" in err and "more than one dimension" in err
    hsdp = ["--gpus", "6", "--tp", "2", "--strategy", "hsdp", "--gpus-per-node", "3"]
    err = _usage_error([*argv, *hsdp], capsys)
    assert "gpus_per_node=3: hsdp shards within a node" in err


def test_expert_parallel_flag_refuses_a_layout_before_profiling(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # --ep is estimate()'s ep keyword; the layouts it does not estimate are usage errors
    # naming the reason, before any model is built
    argv = ["--transformers", "mixtral", "--seq-len", "16", "--device", "cpu", "--json"]
    err = _usage_error([*argv, "--gpus", "4", "--ep", "2"], capsys)
    assert "--ep: ep=2 with gpus=4" in err
    err = _usage_error([*argv, "--gpus", "2", "--ep", "2", "--tp", "2"], capsys)
    assert "--ep: ep=2 with tp=2" in err


# --- every keyword of estimate has a flag ----------------------------------------------------


def test_every_estimate_keyword_has_a_flag() -> None:
    from vram_widget._display.cli_args import build_parser
    from vram_widget._estimating.recipe import KEYWORD_FIELDS

    flags = {s for a in build_parser()._actions for s in a.option_strings}
    # compute_capability is the --gpu's own (its catalog entry), not a flag of its own; the
    # command line builds its Recipe from the flags themselves; tp_plan holds
    # torch.distributed.tensor.parallel style objects, which a command line cannot spell
    # (--tp takes the model's own plan)
    keywords = set(KEYWORD_FIELDS) - {"compute_capability", "tp_plan"}
    missing = [k for k in keywords if "--" + k.replace("_", "-") not in flags]
    assert missing == []
    assert {"--optimizer", "--precision", "--mode", "--batch-size", "--gpu"} <= flags


def test_new_tokens_flag_is_estimate_generate(capsys: pytest.CaptureFixture[str]) -> None:
    transformers = pytest.importorskip("transformers")
    argv = [*_GPT2, "--device", "cpu", "--precision", "fp32", "--batch-size", "3"]
    out = _run_json([*argv, "--mode", "generate", "--new-tokens", "5"], capsys)
    model = _gpt2_model(transformers)
    prompt = {"input_ids": torch.zeros(1, 16, dtype=torch.long)}  # a prompt: no labels
    est = profile_model(model, inputs=prompt, device="cpu").estimate(
        3, "fp32", mode="generate", new_tokens=5
    )
    (setting,) = out["settings"]
    assert (setting["mode"], setting["optimizer"]) == ("generate", None)
    assert setting["peak_bytes"] == est.peak_bytes
    # one layer x keys and values x 32 x 4 bytes = 256 B per token; 3 sequences of 16 + 4
    assert setting["kv_cache_bytes"] == est.kv_cache_bytes == 3 * 20 * 256


def test_kv_cache_flags_are_estimate_keywords(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("optimum.quanto")
    argv = [*_GPT2, "--device", "cpu", "--precision", "fp32", "--batch-size", "3"]
    generate = ["--mode", "generate", "--new-tokens", "5", "--kv-cache", "quantized"]
    out = _run_json([*argv, *generate, "--kv-bits", "2", "--residual-length", "64"], capsys)
    assert out["kv_cache"] == {
        "backend": "quanto", "nbits": 2, "q_group_size": 64, "residual_length": 64,
    }  # fmt: skip
    (setting,) = out["settings"]
    # one layer's keys and values of 3 sequences x 2 heads x 16 prompt tokens x 16 dims:
    # 1,536 values in 24 groups of 64, packed 4 a byte (384 B) with 24 float32 scales and
    # 24 shifts (96 + 96 B): 576 B x 2 = 1,152; the residual of the 4 decode steps' tokens
    # in fp32: 4 x 3 x 2 x 32 x 4 B = 3,072
    assert setting["kv_cache_bytes"] == 1152 + 3072
    assert setting["kv_cache_bytes_per_token"] == 2 * 32 * 4


def test_weights_flags(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("transformers")
    from vram_widget import Weights

    argv = ["mlp", "--device", "cpu", "--batch-size", "8", "--precision", "bf16"]
    flags = ["--weights", "nf4", "--double-quant", "--compute-dtype", "bf16"]
    out = _run_json([*argv, *flags, "--mode", "inference"], capsys)
    weights = Weights("nf4", double_quant=True, compute_dtype="bf16")
    profile = profile_model(zoo.mlp(), input_size=(784,), device="cpu")
    expected = profile.estimate(8, "bf16", mode="inference", weights=weights)
    (setting,) = out["settings"]
    assert setting["peak_bytes"] == expected.peak_bytes
    assert setting["weights"] == weights.describe() == expected.weights
    assert setting["weights"].startswith("nf4 (bitsandbytes Linear4bit, double quantization")


def test_torchao_weights_flag(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torchao")
    from vram_widget import Weights

    argv = ["mlp", "--device", "cpu", "--batch-size", "8", "--precision", "bf16"]
    out = _run_json([*argv, "--weights", "int8-torchao", "--mode", "inference"], capsys)
    profile = profile_model(zoo.mlp(), input_size=(784,), device="cpu")
    expected = profile.estimate(8, "bf16", mode="inference", weights="int8-torchao")
    (setting,) = out["settings"]
    assert setting["peak_bytes"] == expected.peak_bytes
    assert setting["weights"] == Weights("int8-torchao").describe() == expected.weights


def test_lora_targets_and_rank_flags(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("peft")
    argv = ["mlp", "--device", "cpu", "--batch-size", "8", "--precision", "fp32"]
    out = _run_json([*argv, "--lora-rank", "2", "--lora-targets", "0,3"], capsys)
    profile = profile_model(zoo.mlp(), input_size=(784,), device="cpu")
    expected = profile.estimate(8, "fp32", lora_rank=2, lora_targets=["0", "3"])
    assert out["settings"][0]["peak_bytes"] == expected.peak_bytes
    assert out["settings"][0]["levers"] == expected.levers.describe()
    out = _run_json([*argv, "--gpus", "4", "--strategy", "zero1", "--rank", "3"], capsys)
    expected = profile.estimate(8, "fp32", gpus=4, strategy="zero1", rank=3)
    assert (out["settings"][0]["rank"], out["settings"][0]["peak_bytes"]) == (
        3, expected.peak_bytes,
    )  # fmt: skip


def test_seq_len_flag_on_a_zoo_model(capsys: pytest.CaptureFixture[str]) -> None:
    # a model with a sequence axis other than --transformers: --seq-len is estimate's seq_len
    argv = ["llama_tiny", "--device", "cpu", "--precision", "fp32", "--batch-size", "2"]
    out = _run_json([*argv, "--seq-len", "32"], capsys)
    entry = zoo.ZOO["llama_tiny"]
    profile = profile_model(entry.build(), inputs=entry.make_inputs(2), device="cpu")
    expected = profile.estimate(2, "fp32", seq_len=32)
    assert out["settings"][0]["peak_bytes"] == expected.peak_bytes
    assert expected.peak_bytes != profile.estimate(2, "fp32").peak_bytes  # 32, not 64 tokens


def test_expandable_segments_flag(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run_json(["mlp", "--precision", "fp32", "--expandable-segments"], capsys)
    entry = zoo.ZOO["mlp"]
    profile = profile_model(entry.build(), inputs=entry.make_inputs(2), device="cuda")
    h100 = resolve_gpu("H100 SXM 80GB")
    est = profile.estimate(
        32, "fp32", expandable_segments=True, compute_capability=h100.compute_capability
    )
    assert out["settings"][0]["reserved_bytes"] == est.reserved_bytes
    assert out["settings"][0]["device_bytes"] == est.device_bytes


# --- refused before profiling: exit 2, the valid forms named ----------------------------------


@pytest.fixture
def no_profiling(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any profiling fails the test: a usage error must come before it."""
    import vram_widget

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("profiled before refusing")

    monkeypatch.setattr(vram_widget, "profile_model", refuse)


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--gpu", "256 MiB"], "a CUDA device holds before any tensor"),
        (["--gpu", "807MiB"], "give a larger capacity"),  # 775 MiB context + 32 MiB workspace
        (["--gpus", "12", "--strategy", "hsdp"], "gpus=12 is not a whole number of nodes"),
        (["--gpus", "4", "--rank", "4"], "an int in [0, 4)"),
        (["--strategy", "zero1"], "for --gpus N with N > 1"),
        (["--gpus", "2", "--gpus-per-node", "2"], "--gpus-per-node is for --strategy hsdp"),
        (["--gpus", "2", "--fsdp-units", "0"], "--fsdp-units is for --strategy zero2"),
        (["--new-tokens", "8"], "--new-tokens is for --mode generate"),
        (["--mode", "generate"], "--mode generate needs --new-tokens T"),
        (["--mode", "generate", "--new-tokens", "4"], "a Hugging Face model with generate()"),
        (["--kv-cache", "quantized"], "--kv-cache is for --mode generate; got --mode train"),
        (["--kv-bits", "2", "--q-group-size", "32"], "--kv-bits, --q-group-size: settings of"),
        (["--kv-bits", "3"], "argument --kv-bits: invalid choice: 3 (choose from 4, 2)"),
        (["--kv-cache", "int8"], "invalid choice: 'int8' (choose from 'quantized')"),
        (["--residual-length", "0"], "0 is below 1: give a whole number >= 1"),
        (
            [*_KV_GENERATE, "--new-tokens", "200"],
            "--new-tokens 200 and --residual-length 128: the model's quantized KV cache "
            "quantizes all of it again once 128 new tokens",
        ),
        (
            [*_KV_GENERATE, "--new-tokens", "40", "--residual-length", "4"],
            "--new-tokens 40 and --residual-length 4: the model's quantized KV cache "
            "quantizes all of it again once 4 new tokens",
        ),
        (["--mode", "inference", "--checkpoint", "auto"], "--checkpoint: training only"),
        (["--mode", "inference", "--optimizer", "sgd"], "--optimizer: training only"),
        (["--mode", "inference", "--gpus", "2"], "--gpus: training only"),
        (["--lora-targets", "0"], "give --lora-rank too"),
        (["--lora-rank", "2", "--trainable", "0.*"], "give one"),
        (["--device", "cpu", "--expandable-segments"], "--device cpu has none"),
        (["--rank", "-1"], "not a whole number >= 0"),
        (
            ["--weights", "nf8"],
            "invalid choice: 'nf8' (choose from 'nf4', 'fp4', 'int8', 'int8-torchao', "
            "'int4-torchao', 'nf4-torchao')",
        ),
        (["--double-quant"], "give --weights nf4 or --weights fp4 too"),
        (["--int8-threshold", "0"], "--int8-threshold is a setting of --weights int8"),
        (["--weights", "int8", "--compute-dtype", "bf16"], "--weights nf4 or --weights fp4"),
    ],
)
def test_bad_combinations_refused_before_profiling(
    no_profiling: None, argv: list[str], names: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert names in _usage_error(["mlp", *argv], capsys)


def test_config_key_typo_is_refused(no_profiling: None, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    err = _usage_error(["--transformers", "gpt2", "--config", "n_layers=2"], capsys)
    assert "--config key 'n_layers' is not a field of GPT2Config (gpt2)" in err
    assert "did you mean n_layer" in err
    # the config's aliases are its fields too (GPT-2's hidden_size is n_embd)
    spec_ok = ["--transformers", "gpt2", "--config", "hidden_size=32,n_layer=1,n_head=2",
               "--seq-len", "2000"]  # fmt: skip
    assert "2000 is beyond the model's 1024 learned positions" in _usage_error(spec_ok, capsys)


def test_sequence_past_the_position_table(
    no_profiling: None, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers")
    # _GPT2 has n_positions=64: 65 tokens index past its table, 60 + 8 generated too
    err = _usage_error([*_GPT2[:-1], "65"], capsys)
    assert "--seq-len 65 is beyond the model's 64 learned positions" in err
    assert "N <= 64" in err
    err = _usage_error([*_GPT2[:-1], "60", "--mode", "generate", "--new-tokens", "8"], capsys)
    assert "60 tokens plus --new-tokens 8 is 68 positions, beyond the model's limit of 64" in err


def test_checkpoint_auto_suggests_the_models_own_classes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["resnet18", "--precision", "fp32", "--checkpoint", "auto"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    # ResNet-18 is built of BasicBlocks, in layer1 ... layer4; it has no Bottleneck
    assert "checkpoint='BasicBlock'" in err
    assert "checkpoint=['layer1', 'layer2']" in err
    assert "Bottleneck" not in err


# --- one figure decides "fits", and it is the one shown ---------------------------------------


def test_device_bytes_decide_fits_on_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    entry = zoo.ZOO["mlp"]
    profile = profile_model(entry.build(), inputs=entry.make_inputs(2), device="cuda")
    est = profile.estimate(32, "fp32", compute_capability=(9, 0))
    assert est.device_bytes is not None
    # at exactly device_bytes it fits; 2 MiB less (the allocator's segment unit) it does not
    for capacity, fits in ((est.device_bytes, True), (est.device_bytes - 2**21, False)):
        argv = ["mlp", "--precision", "fp32", "--gpu", str(capacity)]
        out = _run_json(argv, capsys)
        (setting,) = out["settings"]
        assert setting["fit_bytes"] == setting["device_bytes"] == est.device_bytes
        assert setting["fits"] is fits is est.fits(capacity)
        assert "device_bytes" in out["fit_bytes_means"]
        assert "not the figure compared" in out["total_bytes_means"]
        assert main(argv) == 0
        lines = capsys.readouterr().out.splitlines()
        header = next(line for line in lines if line.startswith("batch"))
        assert header.split()[4:7] == ["allocated", "reserved", "device"]
        row = next(line for line in lines if line.split()[:2] == ["32", "fp32"])
        (fit,) = [line for line in lines if "fits on" in line]
        shown = _bytes(est.device_bytes)
        assert shown in row  # the device column
        assert f": {'yes' if fits else 'no'}, device {shown} of " in fit
        assert _bytes(est.total_bytes) not in fit


def test_help_names_the_fit_figure(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert '"device" is the figure compared with the GPU\'s memory' in out
    assert "--device cpu there is no allocator" in out
    assert "total" not in out.split("examples:")[0]


def test_cpu_output_speaks_of_the_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["mlp", "--device", "cpu", "--precision", "fp32"]) == 0
    text = capsys.readouterr().out
    assert "torch.profiler.profile(profile_memory=True)" in text
    assert "torch.cuda" not in text and "H100" not in text and "fits on" not in text
    assert "no fit verdict: --device cpu assumes no GPU" in text
    header = next(line for line in text.splitlines() if line.startswith("batch"))
    assert "reserved" not in header and "device" not in header


# --- the defaults are named ---------------------------------------------------------------


def test_demo_names_the_assumed_model_and_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--precision", "fp32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # zoo.resnet18's example: one sample is 3 x 64 x 64
    assert lines[0].startswith("assumed model: resnet18 (zoo), one sample 3 x 64 x 64; choose")
    assert lines[1].startswith("assumed GPU: H100 SXM 80GB; choose another with --gpu")
    assert "ResNet: 11,689,512 parameters" in lines[2]
    out = _run_json(["mlp", "--precision", "fp32"], capsys)
    assert out["assumed"] == [lines[1]]  # the GPU only: the model was named


# --- the main job's install -----------------------------------------------------------------


def test_main_install_skips_pip_when_installed(tmp_path: Path) -> None:
    # A python3 on PATH that logs any pip run instead of making it.
    log = tmp_path / "pip.log"
    shim = tmp_path / "python3"
    shim.write_text(
        f'#!/bin/sh\nif [ "$1" = -m ] && [ "$2" = pip ]; then echo "$@" >> {log}; exit 0; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    shim.chmod(0o755)
    root = Path(__file__).resolve().parents[1]
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "HOME": str(tmp_path)}
    run = subprocess.run(
        ["bash", str(root / "scripts" / "install.sh"), "main"],
        capture_output=True, text=True, env=env, timeout=60, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert not log.exists()  # everything was there: no pip run
    bad = subprocess.run(
        ["bash", str(root / "scripts" / "install.sh"), "everything"],
        capture_output=True, text=True, env=env, timeout=60, check=False,
    )  # fmt: skip
    assert bad.returncode == 2
    assert "usage: bash scripts/install.sh [main|test]" in bad.stderr


def test_training_args_file_fills_the_flags_and_refuses_a_conflict(tmp_path: Path) -> None:
    from vram_widget._display.cli_args import build_parser, validate

    path = tmp_path / "args.json"
    path.write_text(json.dumps({"per_device_train_batch_size": 4, "optim": "adamw_torch_fused",
                                "bf16": True, "gradient_accumulation_steps": 2,
                                "max_grad_norm": 0}))  # fmt: skip
    parser = build_parser()
    args = validate(parser, parser.parse_args(["mlp", "--training-args", str(path)]))
    assert (args.batch_size, args.optimizer, args.grad_accumulation) == (4, "adamw-fused", 2)
    assert [p.value for p in args.precisions] == ["amp-bf16"]
    same = ["mlp", "--training-args", str(path), "--batch-size", "4", "--precision", "amp-bf16"]
    assert validate(parser, parser.parse_args(same)).batch_size == 4
    with pytest.raises(SystemExit) as exit_info:
        validate(parser, parser.parse_args(["mlp", "--training-args", str(path),
                                            "--batch-size", "8"]))  # fmt: skip
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit):
        parser.parse_args(["mlp", "--training-args", str(path), "--torchtune-config", "x.yaml"])


def test_optimizer_flag_takes_every_name() -> None:
    from vram_widget._display.cli_args import build_parser
    from vram_widget._estimating.options import optimizer_names

    parser = build_parser()
    for name in optimizer_names():
        assert parser.parse_args(["mlp", "--optimizer", name]).optimizer == name


def test_table_names_the_optimizer_given_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    from vram_widget._display.cli import main

    assert main(["mlp", "--optimizer", "sgd", "--precision", "fp32"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if " train " in line)
    assert row.split()[1:4] == ["fp32", "sgd", "train"]


def test_torchtitan_config_file_fills_the_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    transformers = pytest.importorskip("transformers")
    import torch

    from vram_widget import Recipe, profile_model
    from vram_widget._display.cli import main
    from vram_widget._display.cli_args import build_parser, validate

    path = tmp_path / "job.toml"
    path.write_text(
        '[training]\nlocal_batch_size = 4\nseq_len = 16\ndtype = "bfloat16"\n'
        '[optimizer]\nname = "Adam"\nimplementation = "foreach"\n'
        '[activation_checkpoint]\nmode = "selective"\nselective_ac_option = "op"\n'
    )
    parser = build_parser()
    args = validate(parser, parser.parse_args(["mlp", "--torchtitan-config", str(path)]))
    assert (args.batch_size, args.seq_len, args.optimizer) == (4, 16, "adam-foreach")
    assert (args.checkpoint, args.checkpoint_policy) == ("auto", "op")
    assert [p.value for p in args.precisions] == ["bf16"]
    with pytest.raises(SystemExit):  # another policy than the file's
        validate(parser, parser.parse_args(["mlp", "--torchtitan-config", str(path),
                                            "--checkpoint-policy", "full"]))  # fmt: skip
    with pytest.raises(SystemExit):  # one file at a time
        parser.parse_args(["mlp", "--torchtitan-config", str(path), "--torchtune-config", "x"])
    config = (
        "n_layer=2,n_embd=32,n_head=2,vocab_size=64,n_positions=64,bos_token_id=0,eos_token_id=0"
    )
    argv = ["--transformers", "gpt2", "--config", config, "--device", "cpu",
            "--torchtitan-config", str(path), "--json"]  # fmt: skip
    assert main(argv) == 0
    (setting,) = json.loads(capsys.readouterr().out)["settings"]
    hf_config = transformers.AutoConfig.for_model(
        "gpt2", n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=64,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    ids = torch.zeros(1, 16, dtype=torch.long)
    profile = profile_model(model, inputs={"input_ids": ids, "labels": ids}, device="cpu")
    expected = profile.estimate(recipe=Recipe.from_torchtitan(path))
    assert setting["peak_bytes"] == expected.peak_bytes


def test_pipeline_parallel_flags(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # --pp, --pp-schedule and --microbatches are estimate()'s keywords; --batch-size is the
    # whole step's batch; a layout they do not split is a usage error naming it
    pytest.importorskip("transformers")
    from models import hf_llama

    from vram_widget._display import cli

    config = (
        "num_hidden_layers=2,hidden_size=64,num_attention_heads=4,num_key_value_heads=2,"
        "intermediate_size=128,vocab_size=1000,bos_token_id=0,eos_token_id=0"
    )
    argv = ["--transformers", "llama", "--config", config, "--seq-len", "16", "--device",
            "cpu", "--batch-size", "4", "--precision", "fp32", "--json", "--gpus", "2"]  # fmt: skip
    # each run's profile, asked again below with estimate()'s own keywords: a profile keeps
    # each pipeline question's stage runs, so where the flags reached estimate() as the
    # keywords asked, the answer is the run's own (the Llama's stages are not run twice for
    # one setting); where they reached it as another setting, the asked one runs afresh
    profiles: list[Any] = []

    def kept(*args: Any) -> Any:
        profile, settings = profile_and_settings(*args)
        profiles.append(profile)
        return profile, settings

    profile_and_settings = cli._profile
    monkeypatch.setattr(cli, "_profile", kept)
    assert main([*argv, "--pp", "2", "--pp-schedule", "1f1b", "--microbatches", "2"]) == 0
    out = json.loads(capsys.readouterr().out)["settings"][0]
    profile = profiles[-1]
    # the model of --transformers llama --config ...: tests/models.py's Llama
    assert profile.param_count == sum(p.numel() for p in hf_llama().parameters())
    expected = profile.estimate(4, "fp32", "adam", gpus=2, pp=2, pp_schedule="1f1b", microbatches=2)
    assert out["stage_peak_bytes"] == list(expected.stage_peak_bytes)
    assert (out["peak_bytes"], out["pp"], out["pp_schedule"]) == (expected.peak_bytes, 2, "1f1b")
    err = _usage_error([*argv, "--pp", "2", "--microbatches", "3"], capsys)
    assert "--pp: batch_size=4 is not split evenly into microbatches=3" in err
    err = _usage_error([*argv, "--microbatches", "2"], capsys)
    assert "--microbatches are settings of --pp K" in err
    # --tp with --pp: the world is pp x tp ranks (4 here, not the 2 given)
    err = _usage_error([*argv, "--pp", "2", "--tp", "2"], capsys)
    assert "--pp: pp=2 x tp=2 does not divide gpus=2: gpus is the world size" in err
    # hsdp over stages checks --gpus-per-node's nodes against each stage's 6 ranks
    hsdp = ["--gpus", "12", "--pp", "2", "--strategy", "hsdp", "--gpus-per-node", "4"]
    err = _usage_error([*argv, *hsdp], capsys)
    assert "--pp: pp=2 on gpus=12 with strategy='hsdp' and gpus_per_node=4: hsdp shards" in err
    # ScheduleInterleaved1F1B, 2 stages a rank (the default, given here): each rank's peak
    flags = ["--pp", "2", "--pp-schedule", "interleaved-1f1b", "--stages-per-rank", "2"]
    assert main([*argv, *flags, "--microbatches", "2"]) == 0
    out = json.loads(capsys.readouterr().out)["settings"][0]
    interleaved = profiles[-1].estimate(
        4, "fp32", "adam", gpus=2, pp=2, pp_schedule="interleaved-1f1b", microbatches=2
    )
    assert out["stage_peak_bytes"] == list(interleaved.stage_peak_bytes)
    assert (out["pp_schedule"], out["stages_per_rank"]) == ("interleaved-1f1b", 2)
    err = _usage_error([*argv, "--pp", "2", "--stages-per-rank", "2"], capsys)
    assert "--pp: stages_per_rank=2 with pp_schedule='gpipe'" in err
    # the 2 layers split at layers.1: the even split's stages
    assert main([*argv, "--pp", "2", "--pp-split", "layers.1", "--microbatches", "2"]) == 0
    out = json.loads(capsys.readouterr().out)["settings"][0]
    assert out["stage_peak_bytes"] == list(
        profiles[-1].estimate(4, "fp32", "adam", gpus=2, pp=2, microbatches=2).stage_peak_bytes
    )
