"""The quality-gate verdict of tokenized data, kept with the data, and the trainer's check of it.

The gate judges a whole dataset, so it can only run after every shard is written. The tokenize flow
therefore writes each shard with the verdict `pending` in its Arrow metadata (`dflash.quality_gate`)
and, once the gate has run, `dataset.json` beside the shards: the verdict, the failed checks, the
thresholds and the sha256 of every shard it judged. Shards made elsewhere (tests, benchmarks, other
tools) may carry a final verdict in the same metadata key.

A shard's verdict is the `dataset.json` beside it when that lists the shard's sha256, else the final
verdict in its own metadata, else unknown. The trainer trains only on `passed` shards unless the
run sets `allow_failed_quality_gate` (recorded in run.yaml and in every checkpoint manifest).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

GATE_METADATA_KEY = "dflash.quality_gate"
DATASET_MANIFEST_NAME = "dataset.json"
DATASET_MANIFEST_SCHEMA_VERSION = 1


class FailedCheck(BaseModel):
    dataset: str = Field(description="Source dataset the check failed for, or 'all'.")
    check: str = Field(description="Threshold name in GateThresholds, e.g. max_short_fraction.")
    value: float
    threshold: float
    message: str


class GateVerdict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    verdict: Literal["passed", "failed", "pending"]
    failed_checks: list[FailedCheck] = Field(default_factory=list)
    overridden: bool = Field(False, description="The tokenize run was told to finish despite failed checks.")
    note: str | None = None

    def arrow_metadata(self) -> dict[str, str]:
        return {GATE_METADATA_KEY: self.model_dump_json(exclude_defaults=True)}


PENDING = GateVerdict(verdict="pending", note="written before the dataset's quality gate ran; see dataset.json")


class DatasetManifest(BaseModel):
    """`tokenized/<dataset>/<run>/dataset.json`: the gate's verdict on the shards of one tokenize run."""

    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = DATASET_MANIFEST_SCHEMA_VERSION
    dataset: str
    run: str
    gate: GateVerdict
    thresholds: dict = Field(default_factory=dict)
    shards: dict[str, str] = Field(description="Shard file name -> sha256 of the bytes the gate judged.")
    samples: int = 0
    report: str | None = Field(None, description="URI of the stats report.")

    def to_bytes(self) -> bytes:
        return self.model_dump_json(indent=2).encode()


class UnusableData(ValueError):
    """Training data whose quality gate failed or is unknown."""


def read_dataset_manifest(data: bytes, *, name: str) -> DatasetManifest:
    try:
        return DatasetManifest.model_validate_json(data)
    except ValueError as error:
        raise UnusableData(f"{name}: not a dataset manifest ({error})") from None


def metadata_verdict(metadata: dict[bytes, bytes] | None, *, name: str) -> GateVerdict | None:
    """The verdict in an Arrow schema's metadata; None when it has none."""
    raw = (metadata or {}).get(GATE_METADATA_KEY.encode())
    if raw is None:
        return None
    try:
        return GateVerdict.model_validate_json(raw)
    except ValueError as error:
        raise UnusableData(f"{name}: unreadable {GATE_METADATA_KEY} metadata ({error})") from None


def shard_verdict(*, sha256: str | None, metadata: dict[bytes, bytes] | None, manifest: DatasetManifest | None,
                  name: str) -> tuple[GateVerdict | None, str]:
    """(verdict or None when unknown, where it came from) for one shard."""
    if manifest is not None and sha256 is not None and sha256 in manifest.shards.values():
        return manifest.gate, f"{DATASET_MANIFEST_NAME} of {manifest.dataset}/{manifest.run}"
    own = metadata_verdict(metadata, name=name)
    if own is not None and own.verdict != "pending":
        return own, "its own metadata"
    if own is not None:
        listed = " (it is not among the shards that file lists: written after the gate, or by another run)" \
            if manifest is not None else ""
        return None, f"written by the tokenize flow, but no {DATASET_MANIFEST_NAME} beside it judged it{listed}"
    return None, f"no {GATE_METADATA_KEY} metadata and no {DATASET_MANIFEST_NAME} beside it judged it"


def check_usable(verdicts: list[tuple[str, GateVerdict | None, str]], *, allow_failed: bool) -> list[str]:
    """Refuse (UnusableData, naming every shard and its failed checks) unless every verdict passed;
    with `allow_failed` return the same lines as warnings instead."""
    problems = []
    for name, verdict, origin in verdicts:
        if verdict is None:
            problems.append(f"{name}: no quality-gate verdict ({origin})")
        elif verdict.verdict != "passed":
            checks = "; ".join(f"{c.check}: {c.message}" for c in verdict.failed_checks) or "no check named"
            problems.append(f"{name}: quality gate {verdict.verdict} ({origin}): {checks}")
    if not problems:
        return []
    if allow_failed:
        return [f"allow_failed_quality_gate is set: training on {line}" for line in problems]
    raise UnusableData(
        f"training data refused: {len(problems)} of {len(verdicts)} shard(s) did not pass the quality gate\n"
        + "\n".join(f"- {line}" for line in problems)
        + "\nFix the data and tokenize it again (the tokenize flow writes the verdict), or set "
        "allow_failed_quality_gate: true (CLI: --set allow_failed_quality_gate=true) to train anyway; the "
        "override is recorded in run.yaml and in every checkpoint manifest.")


def verdict_from_problems(problems: list, *, overridden: bool) -> GateVerdict:
    """The verdict for a list of `tokenize.gate.GateProblem`s (empty: passed)."""
    if not problems:
        return GateVerdict(verdict="passed")
    return GateVerdict(verdict="failed", overridden=overridden, failed_checks=[
        FailedCheck(dataset=p.dataset, check=p.check, value=float(p.value), threshold=float(p.threshold),
                    message=p.message) for p in problems])

