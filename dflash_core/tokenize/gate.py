"""The data-quality gate: thresholds over the stats summary that stop a run on a broken dataset.

Checked per source dataset and overall, so one empty dataset cannot hide inside a good mix. Each
problem says what is wrong and what to do; `enforce_gate` raises `QualityGateError` with all of
them unless the caller overrides (then they come back as warnings to log).
"""

from __future__ import annotations

from dataclasses import dataclass

import polars as pl
from pydantic import ConfigDict, Field

from dflash_core.strict import StrictModel
from dflash_core.tokenize.stats import SHORT_LOSS_TOKENS


class GateThresholds(StrictModel):
    model_config = ConfigDict(frozen=True)

    min_samples: int = Field(1, ge=0, description="Fewest tokenized samples a dataset may have.")
    short_loss_tokens: int = Field(SHORT_LOSS_TOKENS, ge=0, description="A sample with this many loss tokens or fewer is 'short'.")
    max_short_fraction: float = Field(0.2, ge=0, le=1, description="Most samples that may be short.")
    max_boilerplate_fraction: float = Field(0.05, ge=0, le=1, description="Most samples whose loss span is only template boilerplate.")
    max_empty_reasoning_fraction: float = Field(0.05, ge=0, le=1, description="Most thinking-mode samples with empty reasoning.")
    max_degenerate_fraction: float = Field(0.05, ge=0, le=1, description="Most samples with n-gram or tool-call loops.")
    max_truncated_fraction: float = Field(0.2, ge=0, le=1, description="Most samples over max_length.")
    max_skipped_fraction: float = Field(0.05, ge=0, le=1, description="Most lines quarantined (bad or untokenizable).")
    max_duplicate_ids: int = Field(0, ge=0, description="Most samples whose id repeats an earlier sample's.")


@dataclass(frozen=True)
class GateProblem:
    dataset: str
    check: str
    value: float
    threshold: float
    message: str


class QualityGateError(ValueError):
    """The data failed the gate: names the dataset, every failed check and what to do, in one message."""

    def __init__(self, problems: list[GateProblem], *, dataset: str = ""):
        self.problems = problems
        self.dataset = dataset
        checks = ", ".join(dict.fromkeys(p.check for p in problems))
        lines = "\n".join(f"- {p.message}" for p in problems)
        subject = f"dataset {dataset}" if dataset else "the tokenized data"
        super().__init__(
            f"{subject} failed the quality gate ({checks}):\n{lines}\n"
            "Fix the data, relax the thresholds (GateThresholds), or set override_quality_gate=True to proceed anyway."
        )

    def __reduce__(self):  # pickled into the result store with the failed run's state
        return _rebuild_gate_error, (self.problems, self.dataset)


def _rebuild_gate_error(problems: list[GateProblem], dataset: str) -> QualityGateError:
    return QualityGateError(problems, dataset=dataset)


def check_gate(summary: pl.DataFrame, thresholds: GateThresholds) -> list[GateProblem]:
    """Problems found in a summary (rows from `stats.summarize`); empty when the data passes."""
    key = summary.columns[0]
    problems = []
    for row in summary.iter_rows(named=True):
        problems += _check_row(str(row[key]), row, thresholds)
    return problems


def enforce_gate(problems: list[GateProblem], *, override: bool, dataset: str = "") -> list[str]:
    """Raise `QualityGateError` on problems, or return them as warnings when `override` is set."""
    if problems and not override:
        raise QualityGateError(problems, dataset=dataset)
    return [f"quality gate overridden: {p.message}" for p in problems]


def _check_row(name: str, row: dict, t: GateThresholds) -> list[GateProblem]:
    samples, skipped = row["samples"], row["skipped"]
    where = f"dataset {name!r}" if name != "all" else "all datasets"
    out: list[GateProblem] = []

    def check(field: str, fraction: float, limit: float, message: str) -> None:
        if fraction > limit:
            out.append(GateProblem(name, field, fraction, limit, f"{where}: {message}"))

    if samples < t.min_samples:
        out.append(GateProblem(name, "min_samples", samples, t.min_samples,
                               f"{where}: {samples} samples tokenized, need >= {t.min_samples}; "
                               "check that the input shards exist and hold valid records"))
    lines = samples + skipped
    if lines:
        check("max_skipped_fraction", skipped / lines, t.max_skipped_fraction,
              f"{_pct(skipped / lines)} of lines were quarantined: read the .quarantine.jsonl files beside the "
              "outputs for the reasons (malformed JSON, wrong roles, too long, ...) and fix the generator")
    if not samples:
        return out
    duplicates = row.get("duplicate_ids", 0)
    if duplicates > t.max_duplicate_ids:
        out.append(GateProblem(name, "max_duplicate_ids", duplicates, t.max_duplicate_ids,
                               f"{where}: {duplicates} samples repeat the id of another sample; ids must be unique "
                               "(completions are matched to prompts by id): the same completions were written "
                               "twice, or two sources share ids. The .quarantine.jsonl files beside the outputs "
                               "hold the later ones (duplicate_id), each naming the first"))
    short = row["short_loss"] / samples
    check("max_short_fraction", short, t.max_short_fraction,
          f"{_pct(short)} of samples have <= {t.short_loss_tokens} loss tokens: completions look empty; "
          "were they generated with thinking mode?")
    boiler = row["boilerplate_only"] / samples
    check("max_boilerplate_fraction", boiler, t.max_boilerplate_fraction,
          f"{_pct(boiler)} of samples have a loss span of template boilerplate only (no generated text): "
          "the server returned empty completions; check its logs and regenerate")
    empty = row["empty_reasoning"] / samples
    check("max_empty_reasoning_fraction", empty, t.max_empty_reasoning_fraction,
          f"{_pct(empty)} of samples generated with thinking on have empty reasoning: the server may not "
          "parse reasoning (reasoning parser) or thinking was off; the drafter would never see thinking tokens")
    degenerate = (row["degenerate_repetition"] + row["degenerate_tool_calls"]) / samples
    check("max_degenerate_fraction", degenerate, t.max_degenerate_fraction,
          f"{_pct(degenerate)} of samples loop ({row['degenerate_repetition']} n-gram loops, "
          f"{row['degenerate_tool_calls']} repeated <tool_call> blocks): filter them or regenerate with a "
          "repetition penalty / lower max_tokens")
    truncated = row["truncated"] / samples
    check("max_truncated_fraction", truncated, t.max_truncated_fraction,
          f"{_pct(truncated)} of samples were cut at max_length: raise max_length or drop long samples "
          "(overlong='drop')")
    return out


def _pct(fraction: float) -> str:
    return f"{fraction * 100:.0f}%" if fraction >= 0.01 else f"{fraction * 100:.2f}%"
