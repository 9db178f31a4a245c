#!/usr/bin/env bash
# Every test, from a fresh machine: install, lint, type-check, then pytest.
# Any non-zero exit fails (pytest's exit 5, "no tests collected", included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python3 -m ruff check vram_widget tests benchmarks
python3 -m mypy
python3 -m pytest
