"""What a person waits for, each in a fresh process, with a cold and a warm profile cache.

Every scenario runs twice in a new Python process: cold (an empty on-disk cache directory)
and warm (the directory the cold process filled). Times are taken inside the process, from
the call to its answer; the imports (``import vram_widget, torch``: about 2-3 s) and building
the model are apart and reported beside them. Scenarios:

* ``show_memory`` of ResNet-50 at 224 and of GPT-2 small (2 x 128 tokens, SDPA) with
  ``device="cuda"``: the widget built with its first figure (what the kernel sends for the
  first paint); then, on that widget, a batch-slider move (median of 20, in a running event
  loop as in a kernel), a new precision (bf16), a new lever (checkpointing each
  ``Bottleneck``, or ``"auto"``: GPT-2's blocks) and, for GPT-2, a new sequence length (512);
* ``profile_model`` of Llama-2-7B's and Llama-2-70B's shapes on the meta device (1 x 128
  tokens + labels), then the first bf16 / AdamW estimate and an estimate at 4,096 tokens;
  peak RSS.

    python3 benchmarks/fresh_speed.py                  # everything (several minutes)
    python3 benchmarks/fresh_speed.py resnet50 gpt2    # some scenarios

Writes ``benchmarks/results/fresh_speed.json`` (``benchmarks/report.py`` puts it in the docs).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "fresh_speed.json"

_CHILD = r"""
import asyncio, json, resource, statistics, sys, time
t0 = time.perf_counter()
import torch
import vram_widget
from vram_widget import profile_model, show_memory, zoo
out = {"import_s": time.perf_counter() - t0}
which = sys.argv[1]


def llama(hidden, intermediate, layers, heads, kv_heads):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, vocab_size=32000,
                         max_position_embeddings=4096)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def gpt2_small():
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(n_layer=12, n_embd=768, n_head=12)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        return GPT2LMHeadModel(config)


def timed(fn):
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


t0 = time.perf_counter()
if which in ("resnet50", "gpt2"):
    if which == "resnet50":
        model, kwargs = zoo.resnet50(), {"input_size": (3, 224, 224)}
    else:
        ids = torch.zeros(2, 128, dtype=torch.long, device="meta")
        model, kwargs = gpt2_small(), {"inputs": {"input_ids": ids, "labels": ids}}
    out["build_s"] = time.perf_counter() - t0
    w, out["show_memory_s"] = timed(lambda: show_memory(model, device="cuda", **kwargs))

    async def moves():
        times = []
        for i in range(20):
            start = time.perf_counter()
            w.batch_size = 1 + (i * 37) % 200
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    out["move_median_s"] = asyncio.run(moves())

    def set_(name, value):
        async def go():
            setattr(w, name, value)
        asyncio.run(go())

    _, out["new_precision_s"] = timed(lambda: set_("precision", "bf16"))
    lever = "Bottleneck" if which == "resnet50" else "auto"
    _, out["new_lever_s"] = timed(lambda: set_("checkpoint", lever))
    if which == "gpt2":
        _, out["new_seq_len_s"] = timed(lambda: set_("seq_len", 512))
    out["peak"] = w.estimate.peak_bytes
else:
    dims = {"llama2-7b": (4096, 11008, 32, 32, 32), "llama2-70b": (8192, 28672, 80, 64, 8)}
    model = llama(*dims[which])
    out["build_s"] = time.perf_counter() - t0
    ids = torch.zeros(1, 128, dtype=torch.long, device="meta")
    start = time.perf_counter()
    profile = profile_model(model, inputs={"input_ids": ids, "labels": ids}, device="cuda",
                            precisions=("bf16",))
    out["profile_s"] = time.perf_counter() - start
    est = profile.estimate(1, precision="bf16", optimizer="adamw")
    out["first_bf16_s"] = time.perf_counter() - start
    long = profile.estimate(1, precision="bf16", optimizer="adamw", seq_len=4096)
    out["at_4096_s"] = time.perf_counter() - start
    out["peak"] = est.peak_bytes
    out["peak_4096"] = long.peak_bytes
out["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps(out))
"""

SCENARIOS = ("resnet50", "gpt2", "llama2-7b", "llama2-70b")


def run(which: str, cache_dir: str) -> dict[str, Any]:
    env = {
        **os.environ,
        "VRAM_WIDGET_CACHE_DIR": cache_dir,
        "PYTHONPATH": str(REPO),
        "PYTHONWARNINGS": "ignore",
    }
    env.pop("VRAM_WIDGET_CACHE", None)
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, which],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{which}: {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def main(argv: list[str]) -> None:
    results: dict[str, Any] = {}
    if RESULTS.exists():
        results = json.loads(RESULTS.read_text())
    results.update(
        python=platform.python_version(), machine=platform.machine(), cpus=os.cpu_count()
    )
    for which in argv or SCENARIOS:
        with tempfile.TemporaryDirectory(prefix="vram_widget_cache_") as cache_dir:
            cold = run(which, cache_dir)
            warm = run(which, cache_dir)
        if cold["peak"] != warm["peak"]:
            raise SystemExit(f"{which}: the warm cache answered differently: {cold} {warm}")
        results[which] = {"cold": cold, "warm": warm}
        print(which, json.dumps(results[which]))
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
