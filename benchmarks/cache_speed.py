"""How long a profile takes with and without the on-disk cache, each in a fresh process.

For each model: a cold process (an empty cache directory) and a warm one (the directory the
cold one filled) profile it and make the first estimate; the time of ``profile_model`` and
of the estimate are measured inside the process (imports and building the model apart).

    python3 benchmarks/cache_speed.py            # ResNet-50 at 224, Llama-2-7B's shape on meta
    python3 benchmarks/cache_speed.py resnet50   # one of them
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_CHILD = """
import json, sys, time
import torch
from vram_widget import profile_model, zoo
which = sys.argv[1]
if which == "resnet50":
    model = zoo.resnet50()
    kwargs = {"input_size": (3, 224, 224), "device": "cuda"}
else:
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                         num_attention_heads=32)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    ids = torch.zeros(1, 128, dtype=torch.long, device="meta")
    kwargs = {"inputs": {"input_ids": ids, "labels": ids}, "device": "cuda"}
start = time.perf_counter()
profile = profile_model(model, **kwargs)
profiled = time.perf_counter()
peak = profile.estimate(1, "fp32", "adam").peak_bytes
done = time.perf_counter()
print(json.dumps({"profile_s": profiled - start, "estimate_s": done - profiled, "peak": peak}))
"""

MODELS = ("resnet50", "llama2-7b-meta")


def run(which: str, cache_dir: str) -> dict[str, float]:
    env = {**os.environ, "VRAM_WIDGET_CACHE_DIR": cache_dir, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, which],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.splitlines()[-1])  # type: ignore[no-any-return]


def main(argv: list[str]) -> None:
    for which in argv or MODELS:
        with tempfile.TemporaryDirectory(prefix="vram_widget_cache_") as cache_dir:
            cold = run(which, cache_dir)
            warm = run(which, cache_dir)
        assert cold["peak"] == warm["peak"], (cold, warm)
        print(
            f"{which}: cold profile {cold['profile_s']:.2f} s + estimate "
            f"{cold['estimate_s']:.3f} s; warm profile {warm['profile_s']:.3f} s + estimate "
            f"{warm['estimate_s']:.3f} s; peak {cold['peak']:,} bytes (same)"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
