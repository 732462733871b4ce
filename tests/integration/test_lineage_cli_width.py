"""`dflash lineage list` piped (stdout not a terminal, no COLUMNS) prints each URI whole on one line, on
the real S3 server: rich would otherwise cut its table to 80 columns and fold every URI.

Run: `.venv/bin/python -m pytest -n 0 -q tests/integration/test_lineage_cli_width.py`
"""

from __future__ import annotations

from dflash_core.layout import ArtifactKind
from dflash_core.lineage import input_ref, write_artifact
from dflash_core.storage import ObjectStore


def test_lineage_list_keeps_uris_whole_when_stdout_is_not_a_terminal(store: ObjectStore, prefix: str, env_settings,
                                                                      monkeypatch) -> None:
    from typer.testing import CliRunner

    from dflash_core import cli

    monkeypatch.delenv("COLUMNS", raising=False)
    source = write_artifact(store, f"{prefix}/prompts/a-dataset-with-a-long-name/v1/prompts-00000.jsonl", b"{}\n",
                            kind=ArtifactKind.PROMPTS)
    made = write_artifact(store, f"{prefix}/completions/a-dataset-with-a-long-name/a-long-run/shard-00000.jsonl",
                          b"{}\n", kind=ArtifactKind.COMPLETIONS, inputs=[input_ref(store, source.key)])
    assert len(made.uri) > 80
    result = CliRunner().invoke(cli.app, ["lineage", "list", prefix])  # CliRunner's stdout is no terminal
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert any(made.uri in line and source.uri in line for line in lines), result.output
    assert max(len(line) for line in lines) > 80
