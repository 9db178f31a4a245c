#!/usr/bin/env bash
# The main job: install, then print the memory estimate of a zoo model for a few settings.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python3 -m vram_widget "$@"
