"""A node as a pydantic record, and the YAML inventory that names them.

    # nodes.yaml
    nodes:
      gpu-1: {host: 10.0.0.5, user: ubuntu, key_path: ~/.ssh/id_ed25519, work_dir: /opt/dflash, gpus: 8}
      here:  {backend: local, work_dir: /tmp/dflash-node}

Credentials are keys or an agent: a password anywhere in a node's entry is refused.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dflash_core.nodes.access import NodeAccess

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class Node(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="Short name; used in S3 keys (`node-backups/<name>/...`).")
    backend: Literal["ssh", "local"] = Field("ssh", description="ssh: reach `host`; local: this machine.")
    host: str | None = Field(None, description="Host name or address (ssh).")
    user: str | None = Field(None, description="Login user (ssh); None: the SSH default.")
    port: int = Field(22, ge=1, le=65535)
    key_path: Path | None = Field(None, description="Private key file; None: the ssh agent or ~/.ssh default keys.")
    known_hosts: Path = Field(Path("~/.ssh/known_hosts"), description="Host keys to verify against.")
    work_dir: str = Field("~/dflash", description="Node-side dir for venv, logs, scripts, configs, PID records.")
    gpus: int | None = Field(None, ge=0, description="GPUs the node must show; provision fails with fewer.")
    connect_timeout_s: float = Field(10.0, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _no_passwords(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in data:
                if "pass" in str(key).lower():
                    raise ValueError(f"field {key!r}: passwords are never read from config; use key_path "
                                     "or an ssh agent")
        return data

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError(f"node name {value!r}: use letters, digits and . _ - (it becomes an S3 key segment)")
        return value

    @model_validator(mode="after")
    def _ssh_needs_host(self) -> Node:
        if self.backend == "ssh" and not self.host:
            raise ValueError(f"node {self.name}: backend ssh needs a host")
        return self

    def connect(self) -> NodeAccess:
        """An open connection to this node (close it, or use it as a context manager)."""
        if self.backend == "local":
            from dflash_core.nodes.local import LocalAccess

            return LocalAccess(self.name)
        from dflash_core.nodes.ssh import SSHAccess

        return SSHAccess(self.name, host=self.host or "", user=self.user, port=self.port, key_path=self.key_path,
                         known_hosts=self.known_hosts, connect_timeout_s=self.connect_timeout_s)


def local_node(work_dir: str | Path, *, name: str = "local", gpus: int | None = None) -> Node:
    return Node(name=name, backend="local", work_dir=str(work_dir), gpus=gpus)


def load_inventory(path: Path) -> dict[str, Node]:
    """Nodes by name from a YAML file with a top-level `nodes:` mapping; errors name the file and node."""
    path = Path(path).expanduser()
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"node inventory {path} does not exist") from None
    except yaml.YAMLError as error:
        raise ValueError(f"node inventory {path} is not valid YAML: {error}") from None
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), dict):
        raise ValueError(f"node inventory {path}: expected a top-level `nodes:` mapping of name -> fields")
    nodes = {}
    for name, fields in data["nodes"].items():
        try:
            nodes[str(name)] = Node.model_validate({"name": str(name), **(fields or {})})
        except ValidationError as error:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'entry'}: {e['msg']}" for e in error.errors())
            raise ValueError(f"node inventory {path}, node {name!r}: {problems}") from None
    return nodes


def find_node(path: Path, name: str) -> Node:
    nodes = load_inventory(path)
    if name not in nodes:
        raise ValueError(f"node {name!r} is not in {path}; known: {', '.join(sorted(nodes)) or 'none'}")
    return nodes[name]
