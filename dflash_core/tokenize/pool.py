"""A process pool that tokenizes shard chunks on every core.

Each worker builds its own `ShardTokenizer` once (from the pickled `TargetTokenizer` spec) and keeps
its caches across chunks and shards. Workers run the Rust tokenizer single-threaded
(TOKENIZERS_PARALLELISM=false): the pool is the parallelism, and nested thread pools would only
fight over the same cores. Processes start from a forkserver, so a pool is safe to open from a
threaded caller (e.g. a Prefect thread-pool task runner).
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

from dflash_core.tokenize.config import TokenizeConfig
from dflash_core.tokenize.duplicates import Duplicate
from dflash_core.tokenize.shard import ChunkResult, ShardTokenizer
from dflash_core.tokenize.target import TargetTokenizer

_worker: ShardTokenizer | None = None
_init_error: Exception | None = None


def _init_worker(target: TargetTokenizer, config: TokenizeConfig) -> None:
    global _worker, _init_error
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        _worker = ShardTokenizer(target=target, config=config)
    except Exception as error:  # raised here it would break the pool (BrokenProcessPool, no reason given)
        _init_error = error


def _run_chunk(chunk: tuple[int, list[bytes], dict[int, Duplicate]]) -> ChunkResult:
    first_line, lines, duplicates = chunk
    if _init_error is not None:
        raise _init_error  # the template's own error, to the shard that asked
    assert _worker is not None, "pool worker was not initialised"
    return _worker.tokenize_lines(lines, first_line=first_line, duplicates=duplicates)


def default_workers() -> int:
    """Cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class TokenizePool:
    """`with TokenizePool(target=..., config=..., workers=N) as pool: tokenize_shard(..., pool=pool)`."""

    def __init__(self, *, target: TargetTokenizer, config: TokenizeConfig, workers: int | None = None,
                 start_method: str = "forkserver"):
        self.workers = workers or default_workers()
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.target = target
        self.config = config
        context = multiprocessing.get_context(start_method)
        if start_method == "forkserver":
            # The server imports tokenizers/transformers once; each worker forks with them loaded.
            context.set_forkserver_preload([__name__])
        self._executor = ProcessPoolExecutor(
            max_workers=self.workers,
            mp_context=context,
            initializer=_init_worker,
            initargs=(target, config),
        )

    def map_chunks(self, chunks: list[tuple[int, list[bytes], dict[int, Duplicate]]]) -> list[ChunkResult]:
        """Results in chunk order."""
        return list(self._executor.map(_run_chunk, chunks))

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> TokenizePool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
