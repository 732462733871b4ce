"""Settings: env prefix, validation messages, secrets kept out of reprs and logs.

Run: `.venv/bin/python -m pytest tests/unit/test_settings.py -q`
"""

from __future__ import annotations

import logging

import pytest
from pydantic import ValidationError

from dflash_core.layout import ArtifactKind, artifact_key, kind_of_key, shard_name
from dflash_core.settings import Settings


def test_env_prefix_and_secret_repr(monkeypatch) -> None:
    monkeypatch.setenv("DFLASH_S3_BUCKET", "from-env")
    monkeypatch.setenv("DFLASH_S3_SECRET_ACCESS_KEY", "super-secret-value")
    settings = Settings(_env_file=None)
    assert settings.s3_bucket == "from-env"
    assert settings.s3_secret_access_key.get_secret_value() == "super-secret-value"
    assert "super-secret-value" not in repr(settings)
    assert "super-secret-value" not in str(settings.model_dump())
    assert "super-secret-value" not in settings.model_dump_json()


def test_secret_not_logged(caplog, monkeypatch) -> None:
    monkeypatch.setenv("DFLASH_S3_ACCESS_KEY_ID", "AKIA-VISIBLE?")
    settings = Settings(_env_file=None)
    with caplog.at_level(logging.INFO):
        logging.getLogger("test").info("settings: %s", settings)
    assert "AKIA-VISIBLE?" not in caplog.text


def test_dotenv_file_is_read(tmp_path, monkeypatch) -> None:
    (tmp_path / ".env").write_text("DFLASH_S3_REGION=eu-west-9\n")
    monkeypatch.chdir(tmp_path)
    assert Settings().s3_region == "eu-west-9"


def test_bad_endpoint_names_the_setting(monkeypatch) -> None:
    monkeypatch.setenv("DFLASH_S3_ENDPOINT_URL", "127.0.0.1:8333")
    with pytest.raises(ValidationError, match="s3_endpoint_url"):
        Settings(_env_file=None)


def test_prefix_override_keeps_other_kinds(monkeypatch) -> None:
    monkeypatch.setenv("DFLASH_S3_PREFIXES", '{"checkpoint": "runs/ckpt/"}')
    prefixes = Settings(_env_file=None).s3_prefixes
    assert prefixes[ArtifactKind.CHECKPOINT] == "runs/ckpt"
    assert prefixes[ArtifactKind.COMPLETIONS] == "completions"


def test_key_layout() -> None:
    prefixes = Settings(_env_file=None).s3_prefixes
    key = artifact_key(prefixes, ArtifactKind.COMPLETIONS, "sharegpt", "run-1", shard_name(3, suffix="jsonl"))
    assert key == "completions/sharegpt/run-1/shard-00003.jsonl"
    assert kind_of_key(prefixes, key) == ArtifactKind.COMPLETIONS
    with pytest.raises(ValueError, match="not allowed"):
        artifact_key(prefixes, ArtifactKind.COMPLETIONS, "../etc")
