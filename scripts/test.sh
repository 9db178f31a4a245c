#!/usr/bin/env bash
# Every test, from a fresh machine: install, lint, type-check, then pytest.
# Any non-zero exit fails (pytest's exit 5, "no tests collected", included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python3 -m ruff check vram_widget tests benchmarks
python3 -m mypy
lint-imports
# The documentation site (mkdocs.yml): strict, so a broken link, a missing page or a docstring
# that mkdocstrings cannot parse fails; built into a temporary directory, nothing left behind.
site_dir="$(mktemp -d)"
# (not --quiet: it hides the warnings --strict counts, and a broken docstring would pass)
NO_MKDOCS_2_WARNING=1 python3 -m mkdocs build --strict --site-dir "$site_dir"
rm -rf "$site_dir"
python3 -m pytest --durations=25
# Once more under a narrower instruction set than this CPU may have. Which kernels run (and so
# what measure() sees and what the CPU probes measure) depends on the ISA: oneDNN takes its
# bf16 paths only with avx512_bf16 or AMX, and ATen dispatches its vectorized kernels by CPU
# capability. Capping both to AVX2 runs the CPU-kernel-sensitive tests (tests/, without the
# notebooks, the doctests and the browser) on the kernels of a CPU without AVX-512, which
# every x86-64 CPU we support can run. The tests marked slow (long end-to-end runs of models whose kernels the
# other tests also run) are left to the first pass, to keep the whole under the time CI allows.
# ONEDNN_MAX_CPU_ISA: oneDNN's dispatcher control
# (https://uxlfoundation.github.io/oneDNN/dev_guide_cpu_dispatcher_control.html);
# ATEN_CPU_CAPABILITY: aten/src/ATen/native/DispatchStub.cpp (compute_cpu_capability).
# Left out of this pass too: the files that check the widget, the figures, the command line,
# the Recipe and the allocator replay against the estimate made in the same process (or plain
# numpy), and those whose figures are sizes no kernel chooses (a loaded model's storages,
# the bytes a collective sends, an estimate read back from the disk cache), which the
# instruction set does not change; the first pass runs them.
export ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2
python3 -c 'import torch; print("narrowed ISA: ATen", torch.backends.cpu.get_cpu_capability())'
same_process=()
for f in widget widget_pipeline widget_weights widget_ranks widget_kv_cache plotly_widget figures \
    notebooks binder cli cli_layouts layouts recipe recipe_conflicts allocator replaying \
    loading communication disk_cache; do
    same_process+=(--ignore="tests/test_$f.py")
done
python3 -m pytest tests -m "not browser and not slow" -q --durations=15 "${same_process[@]}"
