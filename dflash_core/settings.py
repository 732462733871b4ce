"""One settings object for the whole project, resolved once and passed explicitly.

Values come from keyword arguments, then `DFLASH_*` environment variables, then an optional
`.env` file. Nothing here runs at import time: call `load_settings()` where a command starts.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from dflash_core.layout import ArtifactKind, DEFAULT_PREFIXES


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="DFLASH_",
        env_file=".env",
        env_file_encoding="utf-8",
        env_nested_delimiter="__",
        extra="ignore",
    )

    s3_endpoint_url: str = Field(
        "http://127.0.0.1:8333",
        description="S3 endpoint; the embedded default is the local SeaweedFS server.",
    )
    s3_region: str = Field("us-east-1", description="S3 region name sent with each request.")
    s3_bucket: str = Field("dflash", description="Bucket that holds every artifact of this project.")
    s3_access_key_id: SecretStr = Field(SecretStr("dflash-local"), description="S3 access key id.")
    s3_secret_access_key: SecretStr = Field(
        SecretStr("dflash-local-secret"), description="S3 secret access key."
    )
    s3_prefixes: dict[ArtifactKind, str] = Field(
        default_factory=lambda: dict(DEFAULT_PREFIXES),
        description="Key prefix per artifact kind (see dflash_core.layout).",
    )
    s3_max_attempts: int = Field(6, ge=1, description="Attempts per S3 call (adaptive retry) on transient faults.")
    work_dir: Path = Field(
        Path(".dflash"),
        description="Local work dir: service data, PIDs, logs, caches. Keep it on local disk.",
    )
    prefect_api_url: str = Field(
        "http://127.0.0.1:4200/api", description="Prefect API the flows and CLI talk to."
    )

    # Ports of the local SeaweedFS server; each HTTP port also opens gRPC at +10000.
    s3_master_port: int = 9333
    s3_volume_port: int = 8380
    s3_filer_port: int = 8888
    s3_admin_port: int = 23646

    @field_validator("s3_endpoint_url", "prefect_api_url")
    @classmethod
    def _must_be_http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"must start with http:// or https://, got {value!r}")
        return value.rstrip("/")

    @field_validator("s3_prefixes")
    @classmethod
    def _prefixes_complete(cls, value: dict[ArtifactKind, str]) -> dict[ArtifactKind, str]:
        merged = dict(DEFAULT_PREFIXES)
        merged.update({kind: prefix.strip("/") for kind, prefix in value.items()})
        return merged

    @property
    def s3_port(self) -> int:
        """Port of `s3_endpoint_url` (the local S3 server listens there)."""
        from urllib.parse import urlparse

        parsed = urlparse(self.s3_endpoint_url)
        return parsed.port or (443 if parsed.scheme == "https" else 80)

    @property
    def prefect_port(self) -> int:
        from urllib.parse import urlparse

        return urlparse(self.prefect_api_url).port or 4200

    def replace(self, **changes: object) -> Settings:
        """A validated copy with `changes` applied (model_copy would skip validation)."""
        return type(self)(_env_file=None, **{**self.model_dump(), **changes})

    def work_path(self, *parts: str) -> Path:
        """A path under the work dir, made absolute so child processes agree on it."""
        return self.work_dir.expanduser().resolve().joinpath(*parts)


def load_settings(**overrides: object) -> Settings:
    """Resolve settings once (kwargs > env > .env > defaults)."""
    return Settings(**overrides)


def default_runs_dir() -> Path:
    """Where training runs keep checkpoints and their shard cache unless told: `runs` under the work dir of the
    process that reads the run config (never its cwd: a stage's worker runs in the checkout)."""
    return load_settings().work_path("runs")
