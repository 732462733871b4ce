#!/usr/bin/env bash
# Create .venv and install the project with its pinned dependencies. Idempotent; safe on a fresh clone.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.dflash-installed
want=$(cat pyproject.toml infra/requirements-nodeps.txt | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/pip install --quiet --disable-pip-version-check -e '.[dev]'
  .venv/bin/pip install --quiet --disable-pip-version-check --no-deps -r infra/requirements-nodeps.txt
  echo "$want" > "$stamp"
fi
