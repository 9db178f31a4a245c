"""Speed: how long profiling takes, how fast an estimate answers, and how little memory a
meta-device giant needs.

    python benchmarks/speed.py            # everything (a few minutes on 2 cores)
    python benchmarks/speed.py --skip-llama
    python benchmarks/speed.py --replay-only  # the allocator replay rows alone

1. ResNet-50 (torchvision architecture) at 3x224x224: ``profile_model`` (fp32, training and
   inference, Adam; both devices) against ``torchinfo.summary`` of the same model in the same
   process. Each is run once first on a small model so that one-off import costs are not
   counted. ``profile_*_s`` is the best of the repeats; ``profile_*_first_s`` is the first
   profile of ResNet-50 for that device in the process (the cuda one with a cold FakeTensor
   dispatch cache for its shapes; the cpu one, which runs after it, with a cold cache of CPU
   kernel workspace probes). ``bare_fake_*`` is the floor under any fake-tensor profile:
   one training step and one forward of the same model under a stock ``FakeTensorMode``,
   nothing recorded; beside it, a real training step at batch 1 (any method that runs the
   backward pays at least that much) and one fake training step with a symbolic batch.
2. ``ModelProfile.estimate`` latency on a model with more than 200 modules (ResNet-101), median
   of many calls at random batch sizes and settings of cached precisions.
3. A Llama-7B-shaped decoder built on the meta device, profiled in a fresh process: wall time
   and the process's own peak resident memory (VmHWM); the zoo's, and Hugging Face's
   ``LlamaForCausalLM`` with Llama-2-7B's config where ``transformers`` is installed; and
   Llama-2-70B's config with the disk cache off: the first bf16 answer at 128 tokens
   (target <= 15 s from the build's start) and at 4,096 (<= 25 s), beside the floor.

``--only floor_resnet50`` (or ``floor_gpt2``, ``llama_70b_meta``) runs that row alone and
prints it, writing nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# These rows time the profiling work itself: the on-disk profile cache is off here and in every
# process started from here (benchmarks/fresh_speed.py times what the cache saves).
os.environ["VRAM_WIDGET_CACHE"] = "0"

import numpy as np
import torch

from vram_widget import profile_model, zoo
from vram_widget._estimating.allocator import replay
from vram_widget._estimating.estimator import MemoryEstimate
from vram_widget._estimating.replaying import forget_replays, replays_run

# The process's own peak RSS, defined in each measuring script.
_PEAK_RSS = """
import resource
def peak_rss_bytes():
    # VmHWM: this process's own peak RSS. ru_maxrss is not: Linux carries it over exec
    # from the parent, so a child of a large process reports the parent's peak.
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
"""

_LLAMA_SCRIPT = (
    _PEAK_RSS
    + """
import resource, time, json, torch
from vram_widget import profile_model, zoo
with torch.device("meta"):
    model = zoo.llama_decoder(zoo.LLAMA_7B)
t0 = time.perf_counter()
profile = profile_model(model, inputs=torch.zeros(1, 128, dtype=torch.long))
est = profile.estimate(8, "bf16", "adamw")
seconds = time.perf_counter() - t0
t1 = time.perf_counter()
replayed = est.allocator
replay_s = time.perf_counter() - t1
print(json.dumps({
    "seconds": seconds,
    "max_rss_bytes": peak_rss_bytes(),
    "param_count": profile.param_count,
    "closed_form": zoo.llama_param_count(zoo.LLAMA_7B),
    "peak_bytes_bf16_adamw_b8": est.peak_bytes,
    "replay_ms": replay_s * 1e3,
    "replay_events": len(est.event_bytes),
    "reserved_bytes_bf16_adamw_b8": replayed.peak_reserved_bytes,
}))
"""
)


_HF_LLAMA_SCRIPT = (
    _PEAK_RSS
    + """
import resource, time, json, torch, transformers
from vram_widget import profile_model
config = transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008,
                                  num_hidden_layers=32, num_attention_heads=32)
with torch.device("meta"):
    model = transformers.LlamaForCausalLM(config)
ids = torch.zeros(1, 128, dtype=torch.long)
t0 = time.perf_counter()
profile = profile_model(model, inputs={"input_ids": ids, "labels": ids})
est = profile.estimate(8, "bf16", "adamw")
print(json.dumps({
    "seconds": time.perf_counter() - t0,
    "max_rss_bytes": peak_rss_bytes(),
    "param_count": profile.param_count,
    "peak_bytes_bf16_adamw_b8": est.peak_bytes,
    "max_batch_80gib_bf16_adamw": profile.max_batch_size(80 * 2**30, "bf16", "adamw"),
}))
"""
)


# profile_model against its floor, in a fresh process per model (target: <= 2.5x): the
# first profile of the model in the process (imports and a tiny warm-up profile excluded, so
# it counts the FakeTensor dispatch cache misses of the model's own shapes), the best of two
# repeats, and the floor measured in the same process: one training step and one no_grad
# forward of the same model and inputs under a stock FakeTensorMode, nothing recorded (best
# of three after a warm-up). For GPT-2, also the first estimate at another length (the fit
# in the length, several runs, once) and an estimate after it.
_FLOOR_SCRIPT = """
import json, sys, time, warnings
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from vram_widget import profile_model, zoo

warnings.simplefilter("ignore")
which = sys.argv[1]
if which == "resnet50":
    model = zoo.resnet50()
    def make_inputs(device=None, batch=2):
        return (torch.empty(batch, 3, 224, 224, device=device),), {}
    profile_kwargs = {"input_size": (3, 224, 224)}
    loss = lambda out: out.float().mean()
else:
    import transformers
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12, attn_implementation="sdpa")
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    def make_inputs(device=None, batch=2):
        ids = torch.zeros(batch, 128, dtype=torch.long, device=device)
        return (), {"input_ids": ids, "labels": ids}
    args, kwargs = make_inputs("meta")
    profile_kwargs = {"inputs": kwargs}
    loss = lambda out: out.loss

profile_model(zoo.mlp(hidden=(8,)), input_size=(784,))  # imports and one-off set-up

def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0

# precisions=("fp32",): the fp32 training step, inference pass and Adam step profiled up
# front, the work these rows have always timed (the default defers them to the first estimate)
eager = {**profile_kwargs, "precisions": ("fp32",)}
first = timed(lambda: profile_model(model, **eager))
again = min(timed(lambda: profile_model(model, **eager)) for _ in range(2))
# the default: the check that the model runs (one unrecorded fake step and forward), then
# the first fp32 / Adam estimate (the training step and Adam profiled; no inference pass)
default_s = min(timed(lambda: profile_model(model, **profile_kwargs)) for _ in range(2))
default_then_estimate_s = min(
    timed(lambda: profile_model(model, **profile_kwargs).estimate(8)) for _ in range(2))

mode = FakeTensorMode(allow_non_fake_inputs=False)
with mode:
    params = {n: torch.empty(p.shape, dtype=p.dtype).requires_grad_(p.requires_grad)
              for n, p in model.named_parameters()}
    buffers = {n: torch.empty(b.shape, dtype=b.dtype) for n, b in model.named_buffers()}
state = {**params, **buffers}

def step(batch=2):
    model.train()
    with mode:
        a, k = make_inputs(batch=batch)
        loss(functional_call(model, state, a, k)).backward()
    for p in params.values():
        p.grad = None

def forward(batch=2):
    model.eval()
    with mode, torch.no_grad():
        a, k = make_inputs(batch=batch)
        functional_call(model, state, a, k)

step(); forward()
train_s = min(timed(step) for _ in range(3))
forward_s = min(timed(forward) for _ in range(3))
out = {"profile_first_s": first, "profile_again_s": again,
       "default_profile_s": default_s, "default_then_estimate_s": default_then_estimate_s,
       "bare_train_step_s": train_s, "bare_forward_s": forward_s}
# What a profile is made of, each part timed alone (best of 3, warm): one recorded training
# run and one recorded forward at batch 2 (the recorder, hooks and CUDA emulation included),
# and the optimizer's trace (Adam on meta parameters).
from vram_widget._estimating.options import Mode, OptimizerName, Precision
source = profile_model(model, **profile_kwargs, precisions=())._source
source = getattr(source, "inner", source)  # under a disk-cache wrapper
out["recorded_train_s"] = min(
    timed(lambda: source._run(Precision.FP32, 2, Mode.TRAIN)) for _ in range(3))
out["recorded_forward_s"] = min(
    timed(lambda: source._run(Precision.FP32, 2, Mode.INFERENCE)) for _ in range(3))
out["optimizer_trace_s"] = min(
    timed(lambda: source.optimizer_trace(Precision.FP32, OptimizerName.ADAM)) for _ in range(3))
# The same bare step and forward at a batch size no run of this process has used (7): the
# fake dispatch cache misses every op whose shapes hold the batch, as a first profile does.
out["bare_train_step_cold_s"] = timed(lambda: step(7))
out["bare_forward_cold_s"] = timed(lambda: forward(7))
if which == "gpt2":
    profile = profile_model(model, **eager)  # the example's length profiled: the fit alone
    out["first_other_length_s"] = timed(lambda: profile.estimate(8, seq_len=1000))
    out["other_length_after_fit_ms"] = 1e3 * min(
        timed(lambda n=n: profile.estimate(8, seq_len=n)) for n in (300, 500, 777))
print(json.dumps(out))
"""


# Llama-2-70B's shape (transformers' LlamaForCausalLM, SDPA) on the meta device, in a fresh
# process with the disk cache off: the build, profile_model, the first bf16 / AdamW estimate at
# 1 x 128 tokens (targets: <= 15 s from the start of the build), then the same at 4,096 tokens
# (<= 25 s from the start), the process's peak RSS, and the floor in the same process: one bare
# bf16 training step at 2 x 128 under a stock FakeTensorMode, nothing recorded (second of two).
_LLAMA_70B_SCRIPT = (
    _PEAK_RSS
    + """
import os, time, json, warnings, torch, transformers
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from vram_widget import profile_model
warnings.simplefilter("ignore")
transformers.logging.set_verbosity_error()
t0 = time.perf_counter()
config = transformers.LlamaConfig(
    hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
    num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096)
config._attn_implementation = "sdpa"
with torch.device("meta"):
    model = transformers.LlamaForCausalLM(config)
ids = torch.zeros(1, 128, dtype=torch.long)
built = time.perf_counter()
profile = profile_model(model, inputs={"input_ids": ids, "labels": ids})
profiled = time.perf_counter()
est = profile.estimate(1, precision="bf16", optimizer="adamw")
answered = time.perf_counter()
est_4k = profile.estimate(1, seq_len=4096, precision="bf16", optimizer="adamw")
answered_4k = time.perf_counter()
rss = peak_rss_bytes()
mode = FakeTensorMode()
with mode:
    params = {n: torch.empty(p.shape, dtype=torch.bfloat16).requires_grad_()
              for n, p in model.named_parameters()}
    buffers = {n: torch.empty(b.shape, dtype=b.dtype) for n, b in model.named_buffers()}
def bare_step():
    model.train()
    with mode:
        x = torch.zeros(2, 128, dtype=torch.long)
        out = functional_call(model, {**params, **buffers}, (), {"input_ids": x, "labels": x})
        out.loss.backward()
    for p in params.values():
        p.grad = None
bare_step()
t1 = time.perf_counter()
bare_step()
print(json.dumps({
    "build_s": built - t0,
    "profile_model_s": profiled - built,
    "first_bf16_estimate_s": answered - profiled,
    "first_answer_from_start_s": answered - t0,
    "estimate_4k_s": answered_4k - answered,
    "answer_4k_from_start_s": answered_4k - t0,
    "max_rss_bytes": rss,
    "bare_bf16_train_step_s": time.perf_counter() - t1,
    "peak_bytes_bf16_adamw_b1": est.peak_bytes,
    "peak_bytes_bf16_adamw_b1_4k": est_4k.peak_bytes,
}))
"""
)


def profile_vs_floor(which: str) -> dict[str, float]:
    """``_FLOOR_SCRIPT`` for ``which`` ("resnet50" or "gpt2") in a fresh process, with
    the two ratios of the speed targets (docs/speed.md)."""
    done = subprocess.run(
        [sys.executable, "-c", _FLOOR_SCRIPT, which],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "KINETO_LOG_LEVEL": "5"},
    )
    out: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    floor = out["bare_train_step_s"] + out["bare_forward_s"]
    out["profile_over_floor"] = out["profile_again_s"] / floor
    out["first_over_again"] = out["profile_first_s"] / out["profile_again_s"]
    # The least any design costs against the floor: one recorded run per mode and the
    # optimizer (no check, no batch-1 step), and two per mode (a fit checked at a second batch
    # size; the step at batch 1, which kernels run on size-1 paths, can be that second run).
    runs = out["recorded_train_s"] + out["recorded_forward_s"]
    out["one_run_per_mode_over_floor"] = (runs + out["optimizer_trace_s"]) / floor
    out["two_runs_per_mode_over_floor"] = (2 * runs + out["optimizer_trace_s"]) / floor
    # What a cold dispatch cache costs a run, against the same run warm: a first profile
    # runs every shape it has cold, so first / again is about this whatever the number of runs
    cold = out["bare_train_step_cold_s"] + out["bare_forward_cold_s"]
    out["cold_over_warm"] = cold / floor
    return out


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bare_fake_step(model: torch.nn.Module, repeats: int) -> dict[str, float]:
    """The floor under any profile on fake tensors: one forward + backward of the model at
    batch 2 under a stock ``FakeTensorMode`` with nothing recorded (best of ``repeats``
    after one warm-up run, so the fake dispatch cache is warm), and one ``no_grad`` forward.
    A profile runs three of each (two fitted batch sizes and a check)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call

    mode = FakeTensorMode()
    with mode:
        params = {
            n: torch.empty(p.shape).requires_grad_(p.requires_grad)
            for n, p in model.named_parameters()
        }
        buffers = {n: torch.empty(b.shape, dtype=b.dtype) for n, b in model.named_buffers()}
    state = {**params, **buffers}
    training = model.training

    def step() -> None:
        model.train()
        with mode:
            out = functional_call(model, state, (torch.empty(2, 3, 224, 224),))
            out.float().mean().backward()
        for p in params.values():
            p.grad = None

    def forward() -> None:
        model.eval()
        with mode, torch.no_grad():
            functional_call(model, state, (torch.empty(2, 3, 224, 224),))

    def real_step() -> None:
        model.train()
        model(torch.zeros(1, 3, 224, 224)).mean().backward()
        model.zero_grad(set_to_none=True)

    step()
    forward()
    real_step()
    try:
        return {
            "bare_fake_train_step_s": min(_timed(step) for _ in range(repeats)),
            "bare_fake_forward_s": min(_timed(forward) for _ in range(repeats)),
            "real_train_step_b1_s": min(_timed(real_step) for _ in range(repeats)),
            "symbolic_batch_train_step_s": _symbolic_batch_step(model),
        }
    finally:
        model.train(training)
        model.zero_grad(set_to_none=True)


def _symbolic_batch_step(model: torch.nn.Module) -> float:
    """One training step with a symbolic batch dimension (a ShapeEnv, the batch marked
    dynamic): the alternative to three concrete runs, where each allocation's bytes would
    come out as an expression in the batch. Second of two runs (the first fills caches)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call
    from torch.fx.experimental.symbolic_shapes import (
        DimDynamic,
        ShapeEnv,
        StatelessSymbolicContext,
    )

    def once() -> float:
        mode = FakeTensorMode(shape_env=ShapeEnv())
        with mode:
            params = {
                n: torch.empty(p.shape).requires_grad_(p.requires_grad)
                for n, p in model.named_parameters()
            }
            buffers = {n: torch.empty(b.shape, dtype=b.dtype) for n, b in model.named_buffers()}
        dynamic = StatelessSymbolicContext(
            dynamic_sizes=[DimDynamic.DYNAMIC] + [DimDynamic.STATIC] * 3
        )
        x = mode.from_tensor(torch.empty(2, 3, 224, 224), symbolic_context=dynamic)
        t0 = time.perf_counter()
        with mode:
            functional_call(model, {**params, **buffers}, (x,)).float().mean().backward()
        return time.perf_counter() - t0

    model.train()
    once()
    return once()


def profile_vs_torchinfo(repeats: int) -> dict[str, float]:
    import torchinfo

    model = zoo.resnet50()
    warm = zoo.mlp()
    torchinfo.summary(warm, input_size=(1, 784), verbose=0)
    profile_model(warm, input_size=(784,))
    profile_model(warm, input_size=(784,), device="cpu")
    out: dict[str, float] = {}
    out["torchinfo_s"] = min(
        _timed(lambda: torchinfo.summary(model, input_size=(1, 3, 224, 224), verbose=0))
        for _ in range(repeats)
    )
    for device in ("cuda", "cpu"):
        times = [
            _timed(lambda d=device: profile_model(model, input_size=(3, 224, 224), device=d))
            for _ in range(repeats)
        ]
        out[f"profile_{device}_s"] = min(times)
        out[f"profile_{device}_first_s"] = times[0]
    out.update(bare_fake_step(model, max(repeats, 3)))
    return out


def estimate_latency(calls: int) -> dict[str, float]:
    model = zoo.resnet(101)
    profile = profile_model(model, input_size=(3, 64, 64))
    for precision in ("fp32", "bf16"):
        for opt in ("adam", "sgd"):
            profile.estimate(1, precision, opt)
    rng = np.random.default_rng(0)
    times = []
    for _ in range(calls):
        batch = int(rng.integers(1, 8193))
        precision = ("fp32", "bf16")[int(rng.integers(0, 2))]
        opt = ("adam", "sgd")[int(rng.integers(0, 2))]
        t0 = time.perf_counter()
        profile.estimate(batch, precision, opt)
        times.append(time.perf_counter() - t0)
    return {
        "modules": len(list(model.modules())),
        "estimate_median_ms": statistics.median(times) * 1e3,
        "estimate_p90_ms": float(np.percentile(times, 90)) * 1e3,
    }


def replay_latency(est: MemoryEstimate, repeats: int = 9) -> dict[str, float]:
    """The caching-allocator replay of ``est``'s step (``device="cuda"``), cold (nothing
    remembered: ``replaying.forget_replays`` before each), median of ``repeats``, back to
    back with the class-based reference (``allocator.replay``) in the same process: plain,
    with expandable segments, and ``device_bytes`` of a fresh estimate (the free replay and
    a climb of capped ones), then ``device_bytes`` of a fresh estimate of the same setting
    with the replays remembered (what every caller after the first pays). The capped
    replays start from the checkpoints of the free replay and of each other
    (``replaying.fast_replay``): ``device_bytes_in_replays`` is what ``device_bytes`` costs
    in plain replays' time."""
    stream = est._replay_stream
    assert stream is not None
    residents = stream.resident_bytes.tolist()
    events = list(zip(stream.storage.tolist(), stream.nbytes.tolist(), strict=True))

    def cold(fn):  # type: ignore[no-untyped-def]
        def run() -> None:
            forget_replays()
            fn()

        return run

    def fresh() -> MemoryEstimate:
        return dataclasses.replace(est)  # a new estimate: nothing cached on it

    times: dict[str, list[float]] = {k: [] for k in ("ref", "ref_exp", "flat", "flat_exp")}
    for _ in range(repeats):  # interleaved, so that the machine's load falls on both alike
        times["ref"].append(_timed(lambda: replay(residents, events)))
        times["flat"].append(_timed(cold(lambda: est.replayed(False))))
        times["ref_exp"].append(_timed(lambda: replay(residents, events, expandable_segments=True)))
        times["flat_exp"].append(_timed(cold(lambda: est.replayed(True))))
    device = [_timed(cold(lambda: fresh().device_bytes)) for _ in range(repeats)]
    forget_replays()
    before = replays_run()
    device_bytes = fresh().device_bytes
    replays = replays_run() - before
    remembered = [_timed(lambda: fresh().device_bytes) for _ in range(repeats)]
    return {
        "events": len(est.event_bytes) if est.event_bytes is not None else 0,
        "replay_ms": 1e3 * statistics.median(times["flat"]),
        "replay_expandable_ms": 1e3 * statistics.median(times["flat_exp"]),
        "reference_replay_ms": 1e3 * statistics.median(times["ref"]),
        "reference_replay_expandable_ms": 1e3 * statistics.median(times["ref_exp"]),
        "device_bytes_ms": 1e3 * statistics.median(device),
        "device_bytes_replays": replays,
        "device_bytes_in_replays": statistics.median(device) / statistics.median(times["flat"]),
        "device_bytes_remembered_ms": 1e3 * statistics.median(remembered),
        "peak_bytes": est.peak_bytes,
        "reserved_bytes": est.reserved_bytes or 0,
        "device_bytes": device_bytes or 0,
    }


def replay_rows(repeats: int = 9) -> dict[str, dict[str, float]]:
    """:func:`replay_latency` of ResNet-50 at 224 x 224, batch 32, fp32, AdamW, and of the
    Llama-7B shape (on the meta device, 128 tokens) at batch 8, bf16, AdamW."""
    resnet = profile_model(zoo.resnet50(), input_size=(3, 224, 224)).estimate(32, "fp32", "adamw")
    with torch.device("meta"):
        model = zoo.llama_decoder(zoo.LLAMA_7B)
    llama = profile_model(model, inputs=torch.zeros(1, 128, dtype=torch.long))
    return {
        "replay": replay_latency(resnet, repeats),
        "replay_llama_7b": replay_latency(llama.estimate(8, "bf16", "adamw"), repeats),
    }


def llama_meta(script: str = _LLAMA_SCRIPT) -> dict[str, float]:
    env = {**os.environ, "KINETO_LOG_LEVEL": "5"}  # the disk cache off (top of the file)
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--skip-llama", action="store_true")
    parser.add_argument(
        "--replay-only",
        action="store_true",
        help="run only the allocator replay rows, updating them in --out (the others kept)",
    )
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "speed.json"))
    parser.add_argument(
        "--only",
        choices=("floor_resnet50", "floor_gpt2", "llama_70b_meta"),
        help="run this row alone and print it (nothing written)",
    )
    args = parser.parse_args()
    if args.replay_only:
        out = Path(args.out)
        kept = json.loads(out.read_text()) if out.exists() else {}
        rows = replay_rows()
        print(json.dumps(rows, indent=1), flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({**kept, **rows}, indent=1))
        return
    if args.only is not None:
        if args.only == "llama_70b_meta":
            print(json.dumps(llama_meta(_LLAMA_70B_SCRIPT)))
        else:
            print(json.dumps(profile_vs_floor(args.only.removeprefix("floor_"))))
        return
    results: dict[str, object] = {"torch": torch.__version__, "cpus": os.cpu_count()}
    results["resnet50_224"] = profile_vs_torchinfo(args.repeats)
    print("ResNet-50 3x224x224:", results["resnet50_224"], flush=True)
    for which in ("resnet50", "gpt2"):
        results[f"floor_{which}"] = profile_vs_floor(which)
        print(f"{which} against the floor:", results[f"floor_{which}"], flush=True)
    results["estimate"] = estimate_latency(args.calls)
    results.update(replay_rows())
    print("allocator replay:", results["replay"], results["replay_llama_7b"], flush=True)
    print("estimate():", results["estimate"], flush=True)
    if not args.skip_llama:
        results["llama_7b_meta"] = llama_meta()
        print("Llama-7B on meta:", results["llama_7b_meta"], flush=True)
        try:
            import transformers  # noqa: F401
        except ImportError:
            pass
        else:
            results["hf_llama_7b_meta"] = llama_meta(_HF_LLAMA_SCRIPT)
            print("transformers Llama-2-7B on meta:", results["hf_llama_7b_meta"], flush=True)
            results["llama_70b_meta"] = llama_meta(_LLAMA_70B_SCRIPT)
            print("transformers Llama-2-70B on meta:", results["llama_70b_meta"], flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
