#!/usr/bin/env bash
# Installs what the project needs on a fresh machine (Debian, Python 3.10+, root or venv).
#
#   bash scripts/install.sh [test]   everything the tests need (the default): torch, the package
#                                    with its test extras, Debian's Chromium
#   bash scripts/install.sh main     what `python3 -m vram_widget` needs: torch and the
#                                    package's base dependencies, and no pip run at all when
#                                    those are already installed at the right versions
#
# torch first, pinned to 2.13.0: where a local CPU wheel of 2.13.0 is what pip finds, that pin
# resolves to it, whereas a bare "torch" (or a range 2.13.0 does not satisfy) pulls several GB
# of CUDA packages. The package itself only asks for torch>=2.4, which 2.13.0 satisfies.
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-test}"
pip_install() {
    python3 -m pip install --quiet --disable-pip-version-check "$@"
}

# Exit 0 when torch 2.13.0 and every base dependency of pyproject.toml are installed at a
# version it allows, and this checkout's vram_widget imports; any doubt (a missing package,
# no tomllib or packaging to read the requirements with) is exit 1, and pip runs.
base_installed() {
    python3 - <<'PY' 2>/dev/null
import importlib.metadata as md
import tomllib

from packaging.requirements import Requirement

assert md.version("torch").split("+")[0] == "2.13.0"
with open("pyproject.toml", "rb") as f:
    deps = tomllib.load(f)["project"]["dependencies"]
for text in deps:
    req = Requirement(text)
    assert req.specifier.contains(md.version(req.name), prereleases=True), text
import vram_widget  # noqa: E402  (this checkout's: the current directory comes first)
PY
}

case "$what" in
    main)
        if base_installed; then
            exit 0
        fi
        pip_install "torch==2.13.0"
        pip_install -e .
        ;;
    test)
        pip_install "torch==2.13.0"
        # .[test] takes in the optional libraries the tests run for real: bitsandbytes and
        # torchao ([optimizers]), optimum-quanto ([quantized-cache])
        pip_install -e ".[test]"
        # torchtune without its dependencies, which would replace huggingface_hub and fsspec
        # with older versions: the tests load one module of it from its file (its chunked
        # cross-entropy), since `import torchtune` fails next to torchao 0.18.
        pip_install --no-deps "torchtune>=0.6.1,<0.7"
        # torchtitan 0.3.0's Llama (tests/models.py builds it from its model config) without
        # its declared dependencies: datasets, wandb and tensorboard would replace
        # huggingface_hub and fsspec with older versions, and the model needs none of them.
        # What importing torchtitan.models.llama3 does need: spmd_types (its model files) and
        # tyro (torchtitan/config/manager.py, on the package's import chain), with tyro's own
        # dependencies (docstring_parser, typeguard), which replace nothing installed.
        pip_install --no-deps "torchtitan==0.3.0" "spmd_types==0.2.3"
        pip_install "tyro>=1.0,<2"
        # The browser test drives Debian's Chromium (never `playwright install`, which
        # downloads a browser of its own and fails offline). Installed once, when missing and
        # we may install it.
        if ! dpkg -s chromium fonts-dejavu-core >/dev/null 2>&1; then
            if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
                apt-get update -qq
                DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium \
                    fonts-dejavu-core >/dev/null
            else
                echo "install.sh: chromium is missing and apt-get needs root: the browser" \
                    "test will be skipped (and fail under CI=true)" >&2
            fi
        fi
        ;;
    *)
        echo "usage: bash scripts/install.sh [main|test] (default: test)" >&2
        exit 2
        ;;
esac
