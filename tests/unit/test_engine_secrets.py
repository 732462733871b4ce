"""Engine API keys never reach a command line (`/proc/<pid>/cmdline` is readable by every user):
vLLM takes its key from the environment; SGLang, which reads it from argv only, gets it through a
shim that adds it inside the process. Checked on a real process running a stand-in `sglang` module.

Run: `.venv/bin/python -m pytest -q tests/unit/test_engine_secrets.py`
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from dflash_core.serving.profiles import SglangProfile, VllmProfile
from dflash_core.services.process import start_detached, stop

KEY = "sk-secret-0123456789"


def test_vllm_key_goes_by_environment() -> None:
    profile = VllmProfile(model="/m", api_key=KEY)
    assert KEY not in " ".join(profile.argv(port=8000))
    assert profile.instance_env(None)["VLLM_API_KEY"] == KEY


def test_sglang_key_reaches_the_server_but_not_its_command_line(tmp_path) -> None:
    package = tmp_path / "fake" / "sglang"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    seen = tmp_path / "argv.json"
    (package / "launch_server.py").write_text(
        "import json, sys, time\n"
        f"open({str(seen)!r}, 'w').write(json.dumps(sys.argv))\n"
        "time.sleep(60)\n")
    profile = SglangProfile(model="/models/m", api_key=KEY, python=sys.executable)
    argv = profile.argv(port=30000)
    assert KEY not in " ".join(argv)
    env = {**profile.instance_env(None), "PYTHONPATH": str(tmp_path / "fake")}
    record = start_detached("sglang-0", argv, log_path=tmp_path / "log", record_path=tmp_path / "rec.json", env=env)
    try:
        deadline = time.monotonic() + 30
        while not seen.exists() or not seen.read_text():
            assert time.monotonic() < deadline, (tmp_path / "log").read_text()
            time.sleep(0.1)
        server_argv = json.loads(seen.read_text())
        assert server_argv[server_argv.index("--api-key") + 1] == KEY
        assert server_argv[server_argv.index("--model-path") + 1] == "/models/m"
        assert KEY.encode() not in Path(f"/proc/{record.pid}/cmdline").read_bytes()
        # The environment it started with holds the key, but only its owner may read it; argv everyone may.
        assert Path(f"/proc/{record.pid}/environ").stat().st_mode & 0o077 == 0
        assert Path(f"/proc/{record.pid}/cmdline").stat().st_mode & 0o004
    finally:
        stop(record, timeout_s=5)


def test_sglang_without_a_key_runs_the_module_directly() -> None:
    argv = SglangProfile(model="/m").argv(port=1)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
