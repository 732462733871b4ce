"""Why a training run failed, read from its output: one process, or torchrun's ranks followed by its own
ChildFailedError report. The training flow retries only what a second attempt can pass, and its message
quotes the rank's own error line, not torchrun's report.

A rank says why it stops in one of three ways: an `error: <reason>` line (dflash_core.train.entry: a
refusal, or, with the prefixes below, its config or its data), a Python traceback whose last line is the
exception, or nothing (killed by a signal: torchrun's report says which). Kinds, by what a retry does:

- config, data: the run's config or its data is wrong (a ValueError, `UnusableData`): the same again.
- oom: CUDA out of memory: the same config runs out again.
- refused: any other `error:` line (the run is already running, S3 misconfigured, disk full, ...).
- transient: anything else (a connection reset, a collective timeout, a rank killed or preempted, a crash
  with no known cause): a retry resumes from the last checkpoint.

Several ranks fail at once when one does (the others lose their peer): a final kind seen on any rank wins
over a transient one, and the first line of a kind over later ones. A rank whose loop raised says at which
step first (`failed_at_step_line`): the training task makes a transient-looking error final when it recurs at
the same step after a resume. No torch here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Literal

Kind = Literal["config", "data", "oom", "refused", "transient"]
FINAL_KINDS: frozenset[str] = frozenset({"config", "data", "oom", "refused"})

ERROR_PREFIX = "error: "
# What follows `error: ` on a line the entry writes for a config or data error.
KIND_PREFIXES: dict[str, str] = {"config": "run config: ", "data": "training data refused: "}

_FAILED_AT_STEP = re.compile(r"^failed at step (?P<step>\d+)$")
_RANK_PREFIX = re.compile(r"^\[[^\]]*\]:\s?")  # torchrun --tee / --local-ranks-filter: `[rank3]:`, `[default0]:`
_EXCEPTION = re.compile(r"^(?P<name>[A-Za-z_][\w.]*)(?::\s?(?P<message>.*))?$")
_KILLED = re.compile(r"Signal (?P<number>\d+) \((?P<name>SIG\w+)\) received by PID (?P<pid>\d+)")
_TORCHRUN_OWN = ("ChildFailedError",)  # torchrun's own report, never a rank's cause
_CONFIG_ERRORS = ("ValueError", "ValidationError")
_DATA_ERRORS = ("UnusableData",)
_OOM_MARKERS = ("OutOfMemoryError", "CUDA out of memory", "CUDA error: out of memory")


def error_line(kind: Literal["config", "data"], error: BaseException) -> str:
    """The one line the entry exits with for a config or data error (`SystemExit(error_line(...))`)."""
    parts = (part.strip().removeprefix("- ") for part in str(error).splitlines())  # a message's bullets
    reason = "; ".join(part for part in parts if part)
    prefix = KIND_PREFIXES[kind]
    return f"{ERROR_PREFIX}{'' if reason.startswith(prefix) else prefix}{reason}"


def failed_at_step_line(step: int) -> str:
    """The line a rank prints when its training loop raises in (or right after) optimizer step `step`."""
    return f"failed at step {step}"


@dataclass(frozen=True)
class RankFailure:
    """What made a run fail: its kind, the rank's own line saying so, and the step it failed at (None: before
    the loop, or not said)."""

    kind: Kind
    line: str
    step: int | None = None

    @property
    def final(self) -> bool:
        """A retry would fail the same way."""
        return self.kind in FINAL_KINDS


class FailureWatch:
    """Reads a run's output as it streams (torchrun's report is long enough to push a rank's traceback out of
    any short tail) and keeps the lines that say why it stopped."""

    def __init__(self) -> None:
        self._found: list[RankFailure] = []
        self._in_traceback = False
        self._step: int | None = None

    def read(self, line: str) -> None:
        line = _RANK_PREFIX.sub("", line.rstrip())
        if line.startswith("Traceback (most recent call last):"):
            self._in_traceback = True
        elif self._in_traceback and line[:1] not in (" ", "\t", ""):  # the exception ends the traceback
            self._in_traceback = False
            self._exception(line)
        elif (match := _FAILED_AT_STEP.match(line)) and self._step is None:
            self._step = int(match["step"])
        elif line.startswith(ERROR_PREFIX):
            reason = line.removeprefix(ERROR_PREFIX)
            kind = next((k for k, prefix in KIND_PREFIXES.items() if reason.startswith(prefix)), "refused")
            self._found.append(RankFailure(kind, reason))
        elif match := _KILLED.search(line):
            self._found.append(RankFailure("transient", f"a rank was killed by {match['name']} (signal "
                                                        f"{match['number']}, PID {match['pid']})"))

    def _exception(self, line: str) -> None:
        match = _EXCEPTION.match(line)
        name = (match["name"] if match else "").rsplit(".", 1)[-1]
        if name in _TORCHRUN_OWN:
            return
        if any(marker in line for marker in _OOM_MARKERS):
            kind: Kind = "oom"
        elif name in _DATA_ERRORS:
            kind = "data"
        elif name in _CONFIG_ERRORS:
            kind = "config"
        else:
            kind = "transient"
        self._found.append(RankFailure(kind, line))

    def failure(self, returncode: int) -> RankFailure:
        """Why the run that printed what was read exited with `returncode` (not 0), and at which step."""
        return replace(self._cause(returncode), step=self._step)

    def _cause(self, returncode: int) -> RankFailure:
        final = [found for found in self._found if found.final]
        if final:
            return final[0]
        if self._found:
            return self._found[0]
        if returncode < 0:
            return RankFailure("transient", f"the training process was killed by signal {-returncode}")
        return RankFailure("transient", f"the training process exited with {returncode} without saying why")
