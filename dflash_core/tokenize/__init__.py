"""Shard-level tokenization: completion records -> chat-template tokens + loss masks in Arrow shards,
with per-shard/per-dataset statistics, duplicate ids across shards and a data-quality gate. No object
store or orchestrator here.
"""

from dflash_core.tokenize.config import TokenizeConfig
from dflash_core.tokenize.duplicates import Duplicate, find_duplicates, line_ids
from dflash_core.tokenize.gate import GateProblem, GateThresholds, QualityGateError, check_gate, enforce_gate
from dflash_core.tokenize.io import arrow_bytes, quarantine_bytes, read_arrow_bytes
from dflash_core.tokenize.pool import TokenizePool
from dflash_core.tokenize.render import PrefixUnstable, render_sample
from dflash_core.tokenize.shard import SCHEMA, QuarantineLine, ShardResult, ShardTokenizer, tokenize_shard
from dflash_core.tokenize.stats import histogram_png, loss_histogram, sample_frame, skipped_frame, stats_markdown, stats_rows, summarize
from dflash_core.tokenize.target import TargetTokenizer

__all__ = [
    "SCHEMA", "Duplicate", "GateProblem", "GateThresholds", "PrefixUnstable", "QualityGateError",
    "QuarantineLine", "ShardResult", "ShardTokenizer", "TargetTokenizer", "TokenizeConfig", "TokenizePool",
    "arrow_bytes", "check_gate", "enforce_gate", "find_duplicates", "histogram_png", "line_ids",
    "loss_histogram", "quarantine_bytes", "read_arrow_bytes", "render_sample", "sample_frame", "skipped_frame",
    "stats_markdown", "stats_rows", "summarize", "tokenize_shard",
]
