#!/usr/bin/env bash
# Installs everything the project needs on a fresh machine (Debian, Python 3.10+, root or venv).
# torch first, pinned to 2.13.0: on our machines that resolves to a local CPU wheel, whereas a
# bare "torch" (or a range 2.13.0 does not satisfy) pulls several GB of CUDA packages. The
# package itself only asks for torch>=2.4, which the installed 2.13.0 satisfies.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
python3 -m pip install --quiet --disable-pip-version-check -e ".[test]"
