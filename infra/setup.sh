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
  # z-lab's dflash (no-deps list) ships a `dflash` command too: reinstall ours so it is the one on the path
  .venv/bin/pip install --quiet --disable-pip-version-check --no-deps -e .
  echo "$want" > "$stamp"
fi
# vLLM's wheel, read and never installed (it pins its own torch and wants CUDA): tests/unit/test_export_vllm.py
# runs that release's config-loading code on our exports, and fails without it. The version is
# the node wheelhouse's VLLM_VERSION (dflash_core/nodes/wheelhouse.py), read from there; about 290 MiB, downloaded once.
vllm_version=$(sed -n 's/^VLLM_VERSION = "\(.*\)"$/\1/p' dflash_core/nodes/wheelhouse.py)
if ! ls .venv/share/vllm-wheel/vllm-"$vllm_version"-*.whl >/dev/null 2>&1; then
  .venv/bin/pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 -d .venv/share/vllm-wheel "vllm==$vllm_version"
fi
# The SSH backend's tests run a real OpenSSH server on loopback. Where this runs as root on Debian (as CI
# does), install Debian's openssh-server (~6 s; not started as a service); elsewhere those tests skip and say why.
if [ "$(id -u)" = 0 ] && [ ! -x /usr/sbin/sshd ] && command -v apt-get >/dev/null && [ -f /etc/debian_version ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq --no-install-recommends openssh-server >/dev/null 2>&1 \
    || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends openssh-server >/dev/null 2>&1; } \
    || echo "setup.sh: could not install openssh-server; the SSH backend tests will skip" >&2
fi
# The browser test drives the Prefect UI with Debian's chromium and its driver (about a minute the first
# time); installed the same way, and the test skips and says why where they are missing.
if [ "$(id -u)" = 0 ] && ! command -v chromedriver >/dev/null && command -v apt-get >/dev/null \
    && [ -f /etc/debian_version ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null 2>&1 \
    || { apt-get update -qq >/dev/null 2>&1 \
         && apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null 2>&1; } \
    || echo "setup.sh: could not install chromium; the browser test will skip" >&2
fi
