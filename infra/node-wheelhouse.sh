#!/usr/bin/env bash
# Wheels for a node without internet (default: CPython 3.12, manylinux x86_64), written to .carry/node/:
#   controller/  what `python3 -m dflash_core.nodes provision --local` imports on a bare GPU image
#                (pydantic, typer + rich, pyyaml); install with pip --target and put it on PYTHONPATH
#   wheelhouse/  the project's GPU extra (flash-linear-attention, fla-core, einops) for
#                `provision --find-links .carry/node/wheelhouse --no-index`
#   transformers/  the project's transformers pin (+ a huggingface-hub it accepts) for images with an
#                older one; the benches put it on PYTHONPATH with the rest (see bench/bench_hybrid_step.py)
# Run here (where PyPI is reachable): bash infra/node-wheelhouse.sh
# Then on the node, from the repo root with .carry/node beside it (a second run shows `changed: nothing`):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/dflash-ctl .carry/node/controller/*.whl
#   PYTHONPATH=/tmp/dflash-ctl python3 -m dflash_core.nodes provision --local --work-dir /tmp/dflash-node \
#     --system-site-packages --find-links "$PWD/.carry/node/wheelhouse" --no-index --no-deps --gpu-extra \
#     --model-dir MODEL_DIR --no-upload --record-out node-record.json
set -euo pipefail
cd "$(dirname "$0")/.."
PYV=${PYTHON_VERSION:-3.12}
out=.carry/node
rm -rf "$out" && mkdir -p "$out/controller" "$out/wheelhouse" "$out/transformers"
download() {
  .venv/bin/pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version "$PYV" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$@"
}
download "$out/controller" pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing-extensions==4.16.0 typer==0.29.1 annotated-doc==0.0.7 click==8.5.1 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 \
  pygments==2.21.0 shellingham==1.5.4 pyyaml==6.0.3
download "$out/wheelhouse" flash-linear-attention==0.6.0 fla-core==0.6.0 einops==0.8.1
# The project's transformers pin, for images that ship an older one (the H200 image has 5.17, whose
# Qwen3.5 GDN layer repeats q and k up to the value heads before the kernel: 15 ms a step on the 27B
# hybrid, where 5.24 hands fla the grouped heads). huggingface-hub 1.x: 5.24 takes >= 1.31, and the
# 2.x line needs httpx2, which such images lack.
download "$out/transformers" transformers==5.24.0 huggingface-hub==1.33.0
du -sh "$out/controller" "$out/wheelhouse" "$out/transformers"
