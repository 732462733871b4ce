"""Prefect tasks of the training flow: plan, train (torchrun subprocess, logs streamed), report."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, create_table_artifact
from prefect.artifacts import update_progress_artifact

from dflash_core.storage.disk import RUN_DISK_FULL_ADVICE, DiskFull, write_atomically
from dflash_core.layout import TRAIN_RUN_FILES, ArtifactKind, checkpoints_key, is_heldout_key, train_report_key
from dflash_core.lineage import InputRef, Manifest, read_manifest, write_artifact
from dflash_core.planner import PRESETS, Plan, PlanInputs, plan, shape_from_config
from dflash_core.provenance import producer_env
from dflash_core.settings import Settings
from dflash_core.stage_results import Checkpoint, StoredShard
from dflash_core.storage import ObjectStore
from dflash_core.train.config import TrainConfig
from dflash_core.train.launch_argv import Rendezvous, training_argv
from dflash_core.train.rank_failure import FailureWatch, RankFailure
from dflash_core.train.report import curves_png, load_metrics, summary_rows
from dflash_core.train.supervise import die_with_parent
from tasks.plan import NoLayoutFits
from tasks.provenance import run_producer
from tasks.retry import retry_store_outage, retry_unless
from tasks.store import png_artifact


class TrainingFailed(RuntimeError):
    """The training process exited with an error; the message leads with the rank's own error line, then the
    log tail. A retry resumes from the last checkpoint."""


class TrainingRefused(TrainingFailed):
    """The run failed in a way a retry repeats (dflash_core.train.rank_failure): it refused to start or stopped
    with a one-line reason (already running here or on another host, S3 misconfigured or down past the outage
    limit, disk full), or one of the subclasses below."""


class TrainingConfigError(TrainingRefused):
    """A rank refused the run's config (a ValueError: a field, or a checkpoint or device that does not fit it)."""


class TrainingDataError(TrainingRefused):
    """A rank refused the run's data (a shard whose quality gate failed or is unknown)."""


class TrainingOutOfMemory(TrainingRefused):
    """A rank ran out of GPU memory: the same config runs out again."""


class TrainingFailureRecurred(TrainingRefused):
    """A transient-looking error recurred at the same step after a resume from the last checkpoint: the step
    (its data, the state it starts from) makes it, so another retry repeats it."""


_FINAL = {"config": TrainingConfigError, "data": TrainingDataError, "oom": TrainingOutOfMemory,
          "refused": TrainingRefused}
_OOM_ADVICE = ("; lower token_budget (or drafter.num_anchors), or use placement=pair or target_fp8 (`dflash plan` "
               "says what fits)")


# The run dir's record of its last failure, which the next attempt's failure is compared with.
FAILURE_RECORD = "last_failure.json"


def training_failure(failure: RankFailure, *, returncode: int, tail: deque[str],
                     previous: RankFailure | None = None) -> TrainingFailed:
    """The exception a run that failed with `failure` raises: a final one carries the rank's line alone, a
    transient one the log tail as well, unless it repeats `previous` (the attempt before) at the same step."""
    if failure.final:
        return _FINAL[failure.kind](failure.line + (_OOM_ADVICE if failure.kind == "oom" else ""))
    if failure.step is not None and failure == previous:
        return TrainingFailureRecurred(
            f"{failure.line} at step {failure.step} again, after resuming from the last checkpoint: the same error "
            "at the same step is not transient, so it is not retried again; look at what that step trains on "
            "(its batch, the checkpoint it resumed from) or the run's config")
    at_step = f" at step {failure.step}" if failure.step is not None else ""
    return TrainingFailed(f"training exited with {returncode}{at_step}: {failure.line}; a retry resumes from the "
                          "last checkpoint. Log tail:\n" + "\n".join(tail))


def recorded_failure(run_dir: Path) -> RankFailure | None:
    """The failure the run dir's last attempt recorded (None: none, or it ended well since)."""
    try:
        return RankFailure(**json.loads((run_dir / FAILURE_RECORD).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def record_failure(run_dir: Path, failure: RankFailure | None) -> None:
    """Keep `failure` for the next attempt to compare with; None forgets the last one. A record the disk has no
    room for is skipped: the training failure is what the task reports."""
    path = run_dir / FAILURE_RECORD
    if failure is None:
        path.unlink(missing_ok=True)
        return
    with contextlib.suppress(OSError):
        write_atomically(path, json.dumps(asdict(failure)), what=f"the failure record {FAILURE_RECORD}",
                         advice=RUN_DISK_FULL_ADVICE)


# A transient failure (a connection reset, a lost or preempted rank, a crash): a retry resumes from the last
# checkpoint; a refusal, a config or data error, CUDA out of memory or a full disk fails the same way again.
retry_unless_refused = retry_unless(TrainingRefused, DiskFull)


@task(persist_result=True)
def plan_training(config: TrainConfig, *, gpu_memory_gib: float, num_gpus: int, samples: int,
                  mean_tokens: float) -> Plan | None:
    """Refuse a run whose target + drafter + optimizer state fits no GPU layout (None for tiny targets)."""
    if config.target.startswith("tiny:"):
        return None
    shape = PRESETS["smollm2-135m"] if config.target == "embedded" else \
        shape_from_config(Path(config.target) / "config.json")
    drafter = config.drafter
    ranks = max(1, num_gpus // (2 if config.placement == "pair" else 1))  # data-parallel ranks
    result = plan(PlanInputs(target=shape, samples=samples, mean_tokens=mean_tokens,
                             tapped_layers=drafter.tap_count(num_target_layers=shape.num_layers),
                             drafter_layers=drafter.num_layers, block_size=drafter.block_size,
                             anchors_per_1k_tokens=config.resolved_num_anchors * 1000 / config.token_budget,
                             token_budget=config.token_budget, gpu_memory_gib=gpu_memory_gib, num_gpus=num_gpus,
                             target_fp8=config.target_fp8, drafter_fp8=config.drafter_fp8,
                             lm_head_fp8=config.lm_head_fp8, variant=drafter.variant,
                             conv_kernel_size=drafter.conv_kernel_size, conv_group_size=drafter.conv_group_size,
                             selector_rank=drafter.selector_rank, max_steps=config.max_steps,
                             tokens_per_step=config.token_budget * config.optim.grad_accum * ranks))
    if result.data_note:
        get_run_logger().warning(result.data_note)
    chosen = next(v for v in result.layouts if v.layout == config.placement)
    if chosen.fits is False:
        others = [f"{v.layout} would fit ({v.note})" for v in result.layouts if v.fits and v is not chosen]
        raise NoLayoutFits(f"placement {config.placement}: {chosen.note}" + "".join(f"; {o}" for o in others))
    return result


@task(retries=2, retry_delay_seconds=[10, 60], retry_condition_fn=retry_unless_refused)
def run_training(config: TrainConfig, *, nproc_per_node: int, flow_run_id: str | None,
                 rendezvous: Rendezvous | None = None, s3_outage_limit_s: float | None = None) -> str | None:
    """Launch the run (torchrun for several processes or nodes; it dies with this process), stream its log,
    resume on retry; the last checkpoint. None on the nodes of a multi-node job that did not host global
    rank 0 (it writes them)."""
    logger = get_run_logger()
    rendezvous = rendezvous or Rendezvous()
    config.run_dir.mkdir(parents=True, exist_ok=True)
    config_path = config.run_dir / "run.yaml"
    write_atomically(config_path, config.to_yaml(), what="the run config run.yaml", advice=RUN_DISK_FULL_ADVICE)
    extra = (["--flow-run-id", flow_run_id] if flow_run_id else []) + \
        (["--s3-outage-limit-s", str(s3_outage_limit_s)] if s3_outage_limit_s else [])
    argv = training_argv(config_path, nproc_per_node=nproc_per_node, resume=True, rendezvous=rendezvous,
                         extra=extra)
    progress = create_progress_artifact(progress=0.0, description=f"training {config.run_name}")
    tail: deque[str] = deque(maxlen=40)
    watch = FailureWatch()  # reads every line: torchrun's report can push a rank's own error out of the tail
    hosted_rank_0 = False
    # The trainer writes the checkpoints' manifests: they name this task run as their producer.
    env = {**os.environ, **producer_env(run_producer())}
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                          preexec_fn=die_with_parent, env=env) as process:
        for line in process.stdout:
            line = line.rstrip()
            tail.append(line)
            watch.read(line)
            # the trainer's own warnings (samples left out, tails cropped) stand out in the UI's log
            (logger.warning if line.startswith("warning: ") else logger.info)(line)
            if line.startswith("step ") and "/" in line:
                done, total = line.split()[1].split("/")
                update_progress_artifact(progress, progress=100.0 * int(done) / int(total))
            hosted_rank_0 = hosted_rank_0 or line.startswith('{"final_step"')  # printed by global rank 0 only
    if process.returncode == 143:
        raise TrainingFailed("training was stopped by SIGTERM after a checkpoint; a retry resumes it")
    if process.returncode != 0:
        failure, previous = watch.failure(process.returncode), recorded_failure(config.run_dir)
        if not failure.final:  # a final failure is not retried: nothing compares with it
            record_failure(config.run_dir, failure)
        raise training_failure(failure, returncode=process.returncode, tail=tail, previous=previous)
    record_failure(config.run_dir, None)
    if rendezvous.nnodes > 1 and not hosted_rank_0:
        logger.info("global rank 0 ran on another node: its flow run reports, evaluates and exports")
        return None
    from dflash_core.train.checkpoint import latest_checkpoint  # imports torch, which this process needs only here

    checkpoint = latest_checkpoint(config.run_dir / "checkpoints")
    if checkpoint is None:
        raise TrainingFailed(f"training finished but left no checkpoint under {config.run_dir / 'checkpoints'}")
    return str(checkpoint)


@dataclass(frozen=True)
class TrainingReport:
    """What report_training stored: every manifest, and the URIs a Checkpoint record names."""

    manifests: list[Manifest]
    metrics: str
    run_yaml: str | None
    provenance: str | None
    final_metrics: dict


@task(retries=3, retry_delay_seconds=[2, 5, 15], retry_condition_fn=retry_store_outage)
def report_training(settings: Settings, config: TrainConfig, *, checkpoint: str) -> TrainingReport:
    """Curves and a summary table as artifacts; the PNG, metrics.jsonl, run.yaml and provenance.json to S3
    with manifests pointing at the checkpoint. The trainer uploaded the last three to the same keys during
    the run (so they outlive its node); this final write is what ties them to the checkpoint they describe."""
    store = ObjectStore.from_settings(settings)
    metrics = load_metrics(config.run_dir / "metrics.jsonl")
    if metrics.skipped_lines:
        get_run_logger().warning(metrics.skipped_message())
    records = metrics.records
    png = curves_png(records, title=config.run_name)
    checkpoint_uri = store.uri(f"{checkpoint_prefix(settings, config, checkpoint)}/model.safetensors")
    inputs = [InputRef(uri=checkpoint_uri)]
    producer = run_producer()
    key = {name: train_report_key(settings.s3_prefixes, config.run_name, name)
           for name in ("curves.png", *TRAIN_RUN_FILES)}
    manifests = [write_artifact(store, key["curves.png"], png, kind=ArtifactKind.REPORT, inputs=inputs,
                                producer=producer)]
    manifests.append(write_artifact(store, key["metrics.jsonl"], config.run_dir / "metrics.jsonl",
                                    kind=ArtifactKind.REPORT, inputs=inputs, config=config, producer=producer))
    stored = {}
    for name in ("run.yaml", "provenance.json"):
        if (config.run_dir / name).is_file():
            manifests.append(write_artifact(store, key[name], config.run_dir / name, kind=ArtifactKind.REPORT,
                                            inputs=inputs, producer=producer))
            stored[name] = manifests[-1].uri
    create_table_artifact(summary_rows(records, every=max(1, len(records) // 12)), key="training-metrics",
                          description=f"{config.run_name}: loss, expected acceptance length, accuracy at slot 1")
    png_artifact(png, key="training-curves", description=f"{config.run_name}: loss and acceptance length")
    last = {k: v for k, v in (records[-1] if records else {}).items() if isinstance(v, (int, float, str))}
    # The means over the last log window, which is what to read: one step's accuracy is noisy.
    window = (records[-1].get("window") or {}) if records else {}
    last |= {f"window_{k}": v for k, v in window.items() if isinstance(v, (int, float))}
    return TrainingReport(manifests=manifests, metrics=manifests[1].uri, run_yaml=stored.get("run.yaml"),
                          provenance=stored.get("provenance.json"), final_metrics=last)


def checkpoint_prefix(settings: Settings, config: TrainConfig, checkpoint: str) -> str:
    """The S3 key prefix a local checkpoint step dir is uploaded under."""
    return checkpoints_key(settings.s3_prefixes, config.run_name, Path(checkpoint).name)


@task(retries=3, retry_delay_seconds=[2, 5, 15], retry_condition_fn=retry_store_outage)
def stored_checkpoint(settings: Settings, config: TrainConfig, checkpoint: str) -> Checkpoint:
    """The checkpoint record: its S3 step dir when uploaded (so evaluation's inputs are the stored files and
    any host can run it), else the local dir; the shards it was trained on from its manifest's inputs."""
    from dflash_core.layout import CHECKPOINT_META_FILE, CHECKPOINT_MODEL_FILE

    store = ObjectStore.from_settings(settings)
    key = checkpoint_prefix(settings, config, checkpoint)
    step = int(Path(checkpoint).name.rsplit("-", 1)[-1])
    common = {"run_name": config.run_name, "step": step, "target": config.target, "target_seed": config.seed}
    if not store.exists(f"{key}/{CHECKPOINT_META_FILE}"):
        return Checkpoint(uri=str(checkpoint), **common)
    inputs = read_manifest(store, f"{key}/{CHECKPOINT_MODEL_FILE}").inputs
    data = [StoredShard(uri=i.uri, sha256=i.sha256 or "") for i in inputs if i.role is None]  # the target's have a role
    assert not any(is_heldout_key(s.uri) for s in data), "fetch_shards refuses held-out shards"
    return Checkpoint(uri=store.uri(key), data=data, **common)
