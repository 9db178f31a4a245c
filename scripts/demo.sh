#!/usr/bin/env bash
# The main job: install what the command line needs (nothing when it is already there), then
# print the memory estimate of a zoo model for a few settings.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh main
python3 -m vram_widget "$@"
