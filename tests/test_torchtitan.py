"""Recipes read from torchtitan job configs (TOML files written here, keys and defaults as
torchtitan 0.2.2's ``torchtitan/config/job_config.py``), and torchtune's activation keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from vram_widget import Recipe, RecipeSettingIgnored
from vram_widget._estimating.recipe import KEYWORD_FIELDS


def _read(tmp_path: Path, text: str, **kwargs: Any) -> Recipe:
    path = tmp_path / "job.toml"
    path.write_text(text, encoding="utf-8")
    return Recipe.from_torchtitan(path, **kwargs)


def test_training_section(tmp_path: Path) -> None:
    r = _read(
        tmp_path,
        """
        [training]
        local_batch_size = 4
        seq_len = 1024
        global_batch_size = 16
        max_norm = 0.5
        steps = 100
        dataset = "c4"
        [activation_checkpoint]
        mode = "none"
        """,
    )
    # one device: 16 // (4 x 1) = 4 micro-batches per step
    assert (r.step.batch_size, r.step.seq_len, r.get("grad_accumulation")) == (4, 1024, 4)
    # dtype float32 (default) with mixed_precision_param bfloat16 (default): autocast
    assert r.step.precision.value == "amp-bf16"
    # del pred before loss.backward(); loss = loss_sum / tokens; clip_grad_norm_(max_norm)
    assert (r.get("outputs").value, r.get("loss_scaled"), r.get("clip_grad_norm")) == (
        "freed",
        True,
        0.5,
    )
    assert r.get("gpus") == 1 and r.ignored == ()


def test_defaults_are_torchtitans(tmp_path: Path) -> None:
    # an empty file: local_batch_size 8, seq_len 2048, AdamW fused, selective AC every 2nd
    # layer (ActivationCheckpoint's mode "selective", selective_ac_option "2")
    r = _read(tmp_path, "")
    assert (r.step.batch_size, r.step.seq_len, r.step.precision.value) == (8, 2048, "amp-bf16")
    assert (r.optimizer.name.value, r.optimizer.implementation.value) == ("adamw", "fused")
    assert (r.levers.checkpoint, r.levers.checkpoint_policy) == ("auto", 2)
    assert r.get("clip_grad_norm") == 1.0


@pytest.mark.parametrize(
    ("section", "checkpoint", "policy"),
    [
        ('mode = "none"', None, None),
        ('mode = "full"', "auto", None),
        ('mode = "selective"\nselective_ac_option = "op"', "auto", "op"),
        ('mode = "selective"\nselective_ac_option = "3"', "auto", 3),
        # torchtitan's _apply_layer_sac: `not ac_freq` checkpoints every layer
        ('mode = "selective"\nselective_ac_option = "0"', "auto", 1),
    ],
)
def test_activation_checkpoint_section(
    tmp_path: Path, section: str, checkpoint: object, policy: object
) -> None:
    r = _read(tmp_path, f"[activation_checkpoint]\n{section}\n")
    assert (r.levers.checkpoint, r.levers.checkpoint_policy) == (checkpoint, policy)


@pytest.mark.parametrize(
    ("section", "expected"),
    [
        ('name = "Adam"\nimplementation = "foreach"', ("adam", "foreach", False)),
        ('name = "AdamW"\nimplementation = "for-loop"\nlr = 3e-4', ("adamw", "forloop", False)),
        ("early_step_in_backward = true", ("adamw", "fused", True)),
    ],
)
def test_optimizer_section(tmp_path: Path, section: str, expected: tuple[str, str, bool]) -> None:
    text = f"[optimizer]\n{section}\n"
    if "early_step" in section:
        with pytest.warns(RecipeSettingIgnored, match="max_norm=1.0 with optimizer.early_step"):
            r = _read(tmp_path, text)
        assert r.get("clip_grad_norm") is None  # nothing left to clip
    else:
        r = _read(tmp_path, text)
    opt = r.optimizer
    assert (opt.name.value, opt.implementation.value, opt.in_backward) == expected


def test_dtype_and_mixed_precision(tmp_path: Path) -> None:
    bf16 = _read(tmp_path, '[training]\ndtype = "bfloat16"\n')
    assert bf16.step.precision.value == "bf16"  # parameters, gradients, state all bf16
    fp32 = _read(tmp_path, '[training]\nmixed_precision_param = "float32"\n')
    assert fp32.step.precision.value == "fp32"
    # FSDP over 4 ranks: fully_shard's MixedPrecisionPolicy(param_dtype=bfloat16)
    with pytest.warns(RecipeSettingIgnored, match="training loop"):
        sharded = _read(tmp_path, "[parallelism]\ndata_parallel_shard_degree = 4\n")
    assert sharded.step.precision.value == "amp-bf16"
    # TP without FSDP: maybe_enable_amp turns mixed precision off
    with pytest.warns(RecipeSettingIgnored, match="enable_sequence_parallel=True"):
        tp = _read(
            tmp_path, "[parallelism]\ndata_parallel_shard_degree = 1\ntensor_parallel_degree = 2\n"
        )
    assert tp.step.precision.value == "fp32" and (tp.get("gpus"), tp.get("tp")) == (2, 2)


def test_tensor_parallel_degree(tmp_path: Path) -> None:
    # torchtitan 0.3.0 ParallelismConfig.tensor_parallel_degree -> tp on gpus = tp
    text = "[parallelism]\ndata_parallel_shard_degree = 1\ntensor_parallel_degree = 4\n"
    with pytest.warns(RecipeSettingIgnored) as caught:
        r = _read(
            tmp_path, text + "enable_sequence_parallel = false\ndisable_loss_parallel = true\n"
        )
    assert (r.get("gpus"), r.get("tp")) == (4, 4)
    # sequence parallelism and the vocabulary-parallel loss off: only the loop is listed
    assert len(r.ignored) == 1 and "training loop" in r.ignored[0]
    assert "tensor_parallel_degree" not in str(caught[0].message)
    with pytest.warns(RecipeSettingIgnored) as caught:
        r = _read(
            tmp_path, text + "[compile]\nenable = true\nenable_async_tensor_parallel = true\n"
        )
    named = " ".join(r.ignored)
    for item in ("enable_sequence_parallel", "vocabulary-parallel loss", "compile.enable_async"):
        assert item in named
    # FSDP2 beside tp: dp_shard x tp ranks (parallelize_llama: tp, then fully_shard)
    fsdp_tp = "[parallelism]\ndata_parallel_shard_degree = 2\ntensor_parallel_degree = 2\n"
    with pytest.warns(RecipeSettingIgnored):
        r = _read(tmp_path, fsdp_tp)
    assert (r.get("gpus"), r.get("tp"), r.get("strategy")) == (4, 2, "zero3")
    # fully_shard's MixedPrecisionPolicy(param_dtype=bfloat16), as with FSDP2 alone
    assert r.step.precision.value == "amp-bf16"
    with pytest.warns(RecipeSettingIgnored):
        r = _read(tmp_path, fsdp_tp + 'fsdp_reshard_after_forward = "never"\n')
    assert r.get("strategy") == "zero2"
    # HSDP beside tp: dp_replicate x dp_shard x tp ranks, one replica (dp_shard x tp
    # ranks) the "node" hsdp shards within
    with pytest.warns(RecipeSettingIgnored):
        r = _read(tmp_path, fsdp_tp + "data_parallel_replicate_degree = 2\n")
    assert (r.get("gpus"), r.get("tp"), r.get("strategy"), r.get("gpus_per_node")) == (
        8, 2, "hsdp", 4,
    )  # fmt: skip
    # replicas of whole tp groups (a shard degree of 1): hsdp with one tp group a "node"
    replicas = "[parallelism]\ndata_parallel_shard_degree = 1\ntensor_parallel_degree = 2\n"
    with pytest.warns(RecipeSettingIgnored):
        r = _read(tmp_path, replicas + "data_parallel_replicate_degree = 2\n")
    assert (r.get("gpus"), r.get("tp"), r.get("strategy"), r.get("gpus_per_node")) == (
        4, 2, "hsdp", 2,
    )  # fmt: skip


def test_pipeline_parallel_degree(tmp_path: Path) -> None:
    # pipeline_parallel_degree k -> pp=k; the local batch of 8 split into micro-batches of
    # pipeline_parallel_microbatch_size (default 1): 8 // 1 = 8, schedule "1F1B" by default
    # (torchtitan 0.2.2 Parallelism; pipeline_parallel.py build_pipeline_schedule)
    text = "[training]\nlocal_batch_size = 8\n[parallelism]\npipeline_parallel_degree = 2\n"
    with pytest.warns(RecipeSettingIgnored, match="training loop"):
        r = _read(tmp_path, text + "data_parallel_shard_degree = 1\n")
    got = [r.get(k) for k in ("gpus", "pp", "pp_schedule", "microbatches", "batch_size")]
    assert got == [2, 2, "1f1b", 8, 8]
    # no FSDP under the stages: mixed_precision_param is not applied (maybe_enable_amp)
    assert r.step.precision.value == "fp32" and len(r.ignored) == 1
    # gpus = dp x tp x pp; with a micro-batch of 2: 8 // 2 = 4 micro-batches; the name is
    # matched case-insensitively, as torch's get_schedule_class does
    more = 'pipeline_parallel_microbatch_size = 2\npipeline_parallel_schedule = "gpipe"\n'
    with pytest.warns(RecipeSettingIgnored):
        r = _read(tmp_path, text + "tensor_parallel_degree = 2\n" + more, gpus=8)
    got = [r.get(k) for k in ("gpus", "tp", "pp", "pp_schedule", "microbatches")]
    assert got == [8, 2, 2, "gpipe", 4]
    # dp_shard = 8 // (2 x 2) = 2 ranks left: FSDP2 over each tp x pp group, which
    # torchtitan does not reshard after the forward under pipelining ("default")
    assert r.get("strategy") == "zero2" and r.step.precision.value == "amp-bf16"
    # HSDP over the stages: nodes of the shard degree, each stage 2 x 2 ranks; torchtitan's
    # "default" does not reshard after the forward under pipelining, listed
    hsdp = "data_parallel_replicate_degree = 2\ndata_parallel_shard_degree = 2\n"
    with pytest.warns(RecipeSettingIgnored, match=r"'default' under HSDP with pipeline"):
        r = _read(tmp_path, text + hsdp)
    assert [r.get(k) for k in ("gpus", "pp", "strategy", "gpus_per_node")] == [8, 2, "hsdp", 2]
    # the keys that change the split are listed, the split estimated is the default
    split = (
        'pipeline_parallel_schedule = "Interleaved1F1B"\npipeline_parallel_layers_per_stage = 1\n'
    )
    with pytest.warns(RecipeSettingIgnored, match=r"layers_per_stage=1 \(the stages are split"):
        r = _read(tmp_path, text + "data_parallel_shard_degree = 1\n" + split)
    assert r.get("pp_schedule") == "interleaved-1f1b"
    # global_batch_size counts the data-parallel ranks only (here the 2 ranks are the 2
    # stages of one replica): 16 // (8 x 1) = 2
    with pytest.warns(RecipeSettingIgnored):
        r = _read(tmp_path, text.replace("8\n", "8\nglobal_batch_size = 16\n", 1), gpus=2)
    assert (r.get("gpus"), r.get("grad_accumulation")) == (2, 2)
    bad = {
        'pipeline_parallel_schedule = "ZBVZeroBubble"': r"schedule='ZBVZeroBubble' is not "
        r"estimated; the schedules estimated are 'GPipe', '1F1B', 'Interleaved1F1B'",
        "pipeline_parallel_microbatch_size = 3": r"local_batch_size=8 is not a multiple of "
        r"parallelism.pipeline_parallel_microbatch_size=3",
        "pipeline_parallel_microbatch_size = 0": r"microbatch_size=0; give an integer >= 1",
    }
    for line, message in bad.items():
        with pytest.raises(ValueError, match=message):
            _read(tmp_path, text + line + "\n", gpus=2)


@pytest.mark.parametrize(
    ("section", "gpus", "expected"),
    [
        ("data_parallel_shard_degree = 8", None, (8, "zero3", None)),
        ('data_parallel_shard_degree = 8\nfsdp_reshard_after_forward = "never"', None,
         (8, "zero2", None)),
        ("data_parallel_shard_degree = -1", 4, (4, "zero3", None)),  # the ranks left: 4
        ("data_parallel_replicate_degree = 4\ndata_parallel_shard_degree = 1", None,
         (4, "ddp", None)),
        # HSDP: sharded within groups of 4, replicated across 2 of them
        ("data_parallel_replicate_degree = 2\ndata_parallel_shard_degree = 4", None,
         (8, "hsdp", 4)),
    ],
)  # fmt: skip
def test_parallelism_section(
    tmp_path: Path, section: str, gpus: int | None, expected: tuple[int, str, int | None]
) -> None:
    with pytest.warns(RecipeSettingIgnored, match="training loop"):
        r = _read(tmp_path, f"[parallelism]\n{section}\n", gpus=gpus)
    n, strategy, per_node = expected
    assert (r.get("gpus"), r.get("strategy").value) == (n, strategy)
    if per_node is not None:
        assert r.get("gpus_per_node") == per_node
    # across ranks the loop settings are not estimated (named in the warning and ignored)
    assert r.get("clip_grad_norm") is None


def test_global_batch_counts_the_data_parallel_ranks(tmp_path: Path) -> None:
    text = "[training]\nlocal_batch_size = 2\nglobal_batch_size = 32\n"
    text += "[parallelism]\ndata_parallel_shard_degree = 4\n"
    with pytest.warns(RecipeSettingIgnored):
        r = _read(tmp_path, text)
    assert r.get("grad_accumulation") == 4  # 32 // (2 x 4)


def test_model_compile_and_unknown_sections_are_listed(tmp_path: Path) -> None:
    text = """
    [job]
    dump_folder = "./outputs"
    [metrics]
    log_freq = 1
    [model]
    name = "llama3"
    flavor = "8B"
    converters = ["float8"]
    [compile]
    enable = true
    [float8]
    recipe_name = "rowwise"
    [training]
    local_batch_size = 1
    mystery = 3
    """
    with pytest.warns(RecipeSettingIgnored) as record:
        r = _read(tmp_path, text)
    assert len(record) == 1
    ignored = "; ".join(r.ignored)
    assert "model.name='llama3', model.flavor='8B' (the model estimated is the one profiled)" in (
        ignored
    )
    assert "model.converters=['float8']" in ignored
    assert "compile.enable=True" in ignored
    assert "[float8] {'recipe_name': 'rowwise'} (unknown to this reader)" in ignored
    assert "training.mystery=3 (unknown to this reader)" in ignored
    assert "job" not in ignored and "log_freq" not in ignored  # no effect on memory
    assert len(r.ignored) == 5


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[activation_checkpoint]\nmode = "partial"',
         r"activation_checkpoint.mode='partial'; torchtitan's are 'none', 'full', 'selective'"),
        ('[activation_checkpoint]\nselective_ac_option = "some"',
         r"selective_ac_option='some'; torchtitan's are 'op' .* or an integer string k"),
        ('[activation_checkpoint]\nmode = "memory_budget"', r"mode='memory_budget' is not "
         r"estimated \(torch.compile's partitioner"),
        ('[training]\ndtype = "float16"',
         r"training.dtype='float16'; torchtitan's are 'float32' and 'bfloat16'"),
        ("[training]\nenable_cpu_offload = true", r"enable_cpu_offload is not estimated"),
        ('[optimizer]\nname = "Lion"', r"optimizer.name='Lion'; torchtitan builds Adam, AdamW"),
        ('[optimizer]\nimplementation = "triton"',
         r"implementation='triton'; torchtitan's are 'fused', 'foreach', 'for-loop'"),
        ("[training]\nlocal_batch_size = 0", r"training.local_batch_size=0; give an integer >= 1"),
        ("[training]\nlocal_batch_size = 3\nglobal_batch_size = 8",
         r"global_batch_size=8 is not a multiple of local_batch_size x data-parallel degree"),
        ("[parallelism]\ndata_parallel_shard_degree = 0", r"shard_degree=0; give an integer >= 1, "
         r"or -1"),
        ("[parallelism]\ndata_parallel_shard_degree = 4", r"gpus=2, but the parallelism degrees "
         r"multiply to 4"),
        ('[parallelism]\ndata_parallel_shard_degree = 2\nfsdp_reshard_after_forward = "sometimes"',
         r"fsdp_reshard_after_forward='sometimes'; torchtitan's are 'default', 'always'"),
        ("training = 3", r"\[training\] must be a table"),
        ("[training\n", r"is not TOML"),
    ],
)  # fmt: skip
def test_bad_values_are_refused_naming_the_valid_forms(
    tmp_path: Path, text: str, message: str
) -> None:
    gpus = 2 if "shard_degree = 4" in text else None
    with pytest.raises(ValueError, match=message):
        _read(tmp_path, text, gpus=gpus)


def test_a_dict_is_read_like_its_toml(tmp_path: Path) -> None:
    text = '[training]\nlocal_batch_size = 2\n[activation_checkpoint]\nmode = "full"\n'
    from_file = _read(tmp_path, text)
    from_dict = Recipe.from_torchtitan(
        {"training": {"local_batch_size": 2}, "activation_checkpoint": {"mode": "full"}}
    )
    assert from_file == from_dict
    with pytest.raises(TypeError, match="a torchtitan config must be a dict"):
        Recipe.from_torchtitan(3)


def test_torchtune_activation_keys() -> None:
    base = {"optimizer": {"_component_": "torch.optim.AdamW"}}
    r = Recipe.from_torchtune({**base, "enable_activation_checkpointing": True})
    # each layer checkpointed whole: checkpoint="auto", the default (full) policy
    assert (r.levers.checkpoint, r.levers.checkpoint_policy) == ("auto", None)
    config = {**base, "enable_activation_offloading": True}
    if "offload_activations" in KEYWORD_FIELDS:
        assert Recipe.from_torchtune(config).get("offload_activations") is True
    else:  # no offloading setting yet: named, not dropped
        with pytest.warns(RecipeSettingIgnored, match="enable_activation_offloading=True"):
            offloaded = Recipe.from_torchtune(config)
        assert any("enable_activation_offloading" in i for i in offloaded.ignored)


def test_the_recipe_estimates_a_model(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from models import hf_gpt2, hf_tokens

    from vram_widget import profile_model

    text = "[training]\nlocal_batch_size = 2\nseq_len = 32\n"
    r = _read(tmp_path, text)
    profile = profile_model(hf_gpt2(), inputs=hf_tokens(2, 16), device="cpu")
    est = profile.estimate(recipe=r)
    flat = profile.estimate(
        2, seq_len=32, precision="amp-bf16", optimizer="adamw-fused", checkpoint="auto",
        checkpoint_policy=2, outputs="freed", loss_scaled=True, clip_grad_norm=1.0,
    )  # fmt: skip
    assert (est.batch_size, est.seq_len, est.peak_bytes) == (2, 32, flat.peak_bytes)
    assert est.levers.checkpoint == ("transformer.h.0", "transformer.h.1")
