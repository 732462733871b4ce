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

from dflash_core.layout import ArtifactKind, artifact_key
from dflash_core.provenance import current_producer
from dflash_core.settings import Settings, load_settings
from dflash_core.storage import ObjectStore
from dflash_core.train.checkpoint import complete_checkpoints
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
    existing = complete_checkpoints(config.run_dir / "checkpoints")
    if existing and not args.resume:
        raise SystemExit(f"{config.run_dir} already holds checkpoints up to {existing[-1].name}: pass --resume to "
                         "continue that run, or choose a new run_name")
    settings = load_settings()
    store = _store_if_needed(config, settings)
    trainer = Trainer(config, store=store, models_dir=settings.work_path("models"), dist_info=dist_info,
                      flow_run_id=args.flow_run_id,
                      checkpoint_prefix=artifact_key(settings.s3_prefixes, ArtifactKind.CHECKPOINT, config.run_name))
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


def _store_if_needed(config: TrainConfig, settings: Settings) -> ObjectStore | None:
    if not config.upload_checkpoints and all(Path(item).is_file() for item in config.data):
        return None
    store = ObjectStore.from_settings(settings)
    store.check()
    return store


def training_argv(config_path: Path, *, nproc_per_node: int, resume: bool, extra: list[str] = ()) -> list[str]:
    """The command that runs a training run: this module directly, or under torchrun for N processes."""
    entry = ["-m", "dflash_core.train.entry", "--config", str(config_path), *extra] + (["--resume"] if resume else [])
    if nproc_per_node == 1:
        return [sys.executable, *entry]
    torchrun = str(Path(sys.executable).parent / "torchrun")
    return [torchrun, "--standalone", "--nproc-per-node", str(nproc_per_node), *entry]


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
