"""Process entry point of a training run: `python -m dflash_core.train.entry --config run.yaml`,
one process per device under torchrun (`torchrun --nproc-per-node N -m dflash_core.train.entry ...`).

Exit codes: 0 done, 143 stopped by SIGTERM after writing a checkpoint (rerun with --resume).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from importlib import metadata
from pathlib import Path

import torch
import torch.distributed as dist

from dflash_core.provenance import current_producer
from dflash_core.train.config import TrainConfig
from dflash_core.train.loop import EXIT_PREEMPTED, Distributed, Trainer


def write_run_record(config: TrainConfig) -> None:
    """run.yaml (the resolved config) and provenance.json (git SHA, versions, argv) beside the checkpoints."""
    config.run_dir.mkdir(parents=True, exist_ok=True)
    (config.run_dir / "run.yaml").write_text(config.to_yaml())
    versions = {name: _version(name) for name in ("dflash-pipeline", "torch", "transformers", "prefect")}
    record = {**current_producer().model_dump(), "versions": versions, "python": sys.version.split()[0]}
    (config.run_dir / "provenance.json").write_text(json.dumps(record, indent=2))


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run one DFlash training process.")
    parser.add_argument("--config", type=Path, required=True, help="run.yaml (TrainConfig)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    parser.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint")
    parser.add_argument("--flow-run-id", default=None, help="Prefect flow run that launched this run (lineage)")
    args = parser.parse_args(argv)
    config = TrainConfig.from_yaml(args.config, overrides=args.set)
    dist_info = Distributed.from_env()
    if dist_info.world_size > 1:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(dist_info.local_rank)
        dist.init_process_group(backend=backend)
    store = _store_if_needed(config)
    trainer = Trainer(config, store=store, models_dir=_models_dir(), dist_info=dist_info,
                      flow_run_id=args.flow_run_id)
    try:
        if dist_info.is_main:
            write_run_record(config)
        resumed = args.resume and trainer.resume()
        if not resumed:
            trainer.validate_capture()
        log = _console_logger(config) if dist_info.is_main else None
        result = trainer.run(on_log=log)
    finally:
        trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    if dist_info.is_main:
        print(json.dumps({"final_step": result.final_step, "checkpoint": str(result.checkpoint),
                          "preempted": result.preempted}), flush=True)
    return EXIT_PREEMPTED if result.preempted else 0


def _store_if_needed(config: TrainConfig):
    needs = config.upload_checkpoints or any(not Path(item).is_file() for item in config.data)
    if not needs:
        return None
    from dflash_core.settings import load_settings
    from dflash_core.storage import ObjectStore

    store = ObjectStore.from_settings(load_settings())
    store.check()
    return store


def _models_dir() -> Path:
    from dflash_core.settings import load_settings

    return load_settings().work_path("models")


def _console_logger(config: TrainConfig):
    def log(record: dict) -> None:
        accuracy = record.get("accuracy_per_position", [])
        head = " ".join(f"{a:.2f}" for a in (accuracy[:4] if isinstance(accuracy, list) else [accuracy]))
        print(f"step {record['step']:>6}/{config.max_steps} loss {record['loss']:.4f} "
              f"tau {record['acceptance_length']:.3f} acc[1..] {head} lr {record['lr']:.2e} "
              f"{record['tokens_per_s']:,.0f} tok/s", flush=True)
    return log


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
