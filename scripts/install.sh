#!/usr/bin/env bash
# Installs everything the project needs on a fresh machine (Debian, Python 3.10+, root or venv).
# torch first, pinned to 2.13.0: on our machines that resolves to a local CPU wheel, whereas a
# bare "torch" (or a range 2.13.0 does not satisfy) pulls several GB of CUDA packages. The
# package itself only asks for torch>=2.4, which the installed 2.13.0 satisfies.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
python3 -m pip install --quiet --disable-pip-version-check -e ".[test]"
# The browser test drives Debian's Chromium (never `playwright install`, which downloads a
# browser of its own and fails offline). Installed once, when missing and we may install it.
if ! dpkg -s chromium fonts-dejavu-core >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium fonts-dejavu-core >/dev/null
    else
        echo "install.sh: chromium is missing and apt-get needs root: the browser test will" \
            "be skipped (and fail under CI=true)" >&2
    fi
fi
