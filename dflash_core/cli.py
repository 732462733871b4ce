"""`dflash`: the command line. Each subcommand is a thin shell over a dflash_core function.

Flows are started as subprocesses (`python -m flows.<name>`) so this package never imports Prefect.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dflash_core import planner
from dflash_core.defaults import DEFAULT_BLOCK_SIZE, DEFAULT_NUM_LAYERS, default_tapped_layer_count
from dflash_core.nodes.cli import node_app
from dflash_core.s3audit.cli import lineage_app, s3_app
from dflash_core.settings import load_settings
from dflash_core.strict import not_utf8_text, validation_summary

app = typer.Typer(help="Train DFlash speculative-decoding drafters end to end.", no_args_is_help=True,
                  pretty_exceptions_show_locals=False, add_completion=False)
services_app = typer.Typer(help="Start, stop and inspect the local S3 and Prefect servers.", no_args_is_help=True)
app.add_typer(services_app, name="services")
app.add_typer(node_app, name="node")
app.add_typer(s3_app, name="s3")
app.add_typer(lineage_app, name="lineage")
console = Console()


def _fail(message: str) -> typer.Exit:
    """One `error:` line (not wrapped at the terminal's width) and exit code 2."""
    Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    return typer.Exit(code=2)


@app.command()
def plan(
    preset: Annotated[Optional[str], typer.Option(help=f"Target shape preset: {', '.join(planner.PRESETS)}.")] = None,
    model_config: Annotated[Optional[Path], typer.Option(help="A transformers config.json for the target.")] = None,
    hidden_size: Annotated[Optional[int], typer.Option(help="Target hidden size (overrides preset/config).")] = None,
    num_layers: Annotated[Optional[int], typer.Option(help="Target decoder layers.")] = None,
    target_params: Annotated[Optional[float], typer.Option(help="Target parameters, in billions.")] = None,
    tapped_layers: Annotated[Optional[int], typer.Option(
        help="Target layers the drafter reads; default: train's (one per drafter layer, at least 5).")] = None,
    dtype_bytes: Annotated[int, typer.Option(help="Bytes per stored value (bf16 = 2).")] = 2,
    target_fp8: Annotated[bool, typer.Option(help="Target decoder-layer weights in FP8 (train's target_fp8).")] = False,
    drafter_fp8: Annotated[bool, typer.Option(help="The drafter's linears in FP8 (train's drafter_fp8).")] = False,
    lm_head_fp8: Annotated[bool, typer.Option(help="The loss's LM-head GEMMs in FP8 (train's lm_head_fp8).")] = False,
    samples: Annotated[float, typer.Option(help="Training samples (1e6 is fine).")] = 100_000,
    mean_tokens: Annotated[float, typer.Option(help="Mean tokens per sample.")] = 2000,
    mean_completion_tokens: Annotated[Optional[float], typer.Option(help="Mean generated tokens per sample.")] = None,
    anchors_per_sample: Annotated[int, typer.Option(help="Anchors per sample (anchor-only storage).")] = 512,
    drafter_layers: Annotated[int, typer.Option(help="Drafter decoder layers.")] = DEFAULT_NUM_LAYERS,
    block_size: Annotated[int, typer.Option(help="Draft block size B.")] = DEFAULT_BLOCK_SIZE,
    token_budget: Annotated[int, typer.Option(help="Tokens per micro-batch per GPU.")] = 8192,
    gpu_memory_gib: Annotated[float, typer.Option(help="Usable GiB of one GPU.")] = 139.0,
    num_gpus: Annotated[int, typer.Option(help="GPUs available for training.")] = 1,
    interconnect_gb_s: Annotated[float, typer.Option(help="GPU-to-GPU GB/s.")] = 450.0,
    generation_tokens_per_s: Annotated[float, typer.Option(help="Output tokens/s per inference instance.")] = 2000.0,
    inference_instances: Annotated[int, typer.Option(help="Inference server instances.")] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON (a stable interface).")] = False,
) -> None:
    """Storage, memory, transfer and generation arithmetic, before choosing an architecture."""
    try:
        shape = _resolve_shape(preset, model_config, hidden_size, num_layers, target_params)
        if tapped_layers is None:
            tapped_layers = default_tapped_layer_count(num_layers=drafter_layers, num_target_layers=shape.num_layers)
        inputs = planner.PlanInputs(
            target=shape, tapped_layers=tapped_layers, dtype_bytes=dtype_bytes, target_fp8=target_fp8,
            drafter_fp8=drafter_fp8, lm_head_fp8=lm_head_fp8, samples=samples,
            mean_tokens=mean_tokens, mean_completion_tokens=mean_completion_tokens,
            anchors_per_sample=anchors_per_sample, drafter_layers=drafter_layers, block_size=block_size,
            token_budget=token_budget, gpu_memory_gib=gpu_memory_gib, num_gpus=num_gpus,
            interconnect_gb_s=interconnect_gb_s, generation_tokens_per_s=generation_tokens_per_s,
            inference_instances=inference_instances,
        )
    except ValidationError as error:
        raise _fail(_plan_input_errors(error)) from None
    except ValueError as error:
        raise _fail(str(error)) from None
    result = planner.plan(inputs)
    if as_json:  # the input ranges keep every figure finite; allow_nan=False makes sure it is JSON
        print(json.dumps({"inputs": inputs.model_dump(), **result.model_dump()}, indent=2, allow_nan=False))
    else:
        console.print(planner_table(result))


_OUT_OF_RANGE = ("greater_than", "greater_than_equal", "less_than", "less_than_equal", "int_parsing_size")


def _plan_input_errors(error: ValidationError) -> str:
    """Each bad plan input as its flag, the value given, what is wrong and the range it must be in."""
    lines = []
    for problem in error.errors(include_url=False):
        if not problem["loc"]:  # a check across inputs: its message names the flags
            lines.append(str(problem.get("ctx", {}).get("error", problem["msg"])))
            continue
        name = problem["loc"][-1]  # ("samples",), or ("target", "hidden_size") and ("hidden_size",) of the shape
        field = planner.PlanInputs.model_fields.get(name) or planner.ModelShape.model_fields[name]
        what = "out of range" if problem["type"] in _OUT_OF_RANGE else problem["msg"]
        bounds = _valid_range(field.metadata)
        lines.append(f"--{str(name).replace('_', '-')} {problem['input']}: {what}"
                     + (f"; it must be {bounds}" if bounds else ""))
    return "\n".join(lines)


def _valid_range(constraints: list) -> str:
    """Pydantic field bounds as text: `> 0 and <= 1,000,000`."""
    symbols = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
    bounds = [f"{symbol} {value:,}" if isinstance(value, int) else f"{symbol} {value:g}"
              for constraint in constraints for attr, symbol in symbols.items()
              if (value := getattr(constraint, attr, None)) is not None]
    return " and ".join(bounds)


def _resolve_shape(preset, model_config, hidden_size, num_layers, target_params) -> planner.ModelShape:
    if preset is not None and model_config is not None:
        raise ValueError("pass --preset or --model-config, not both")
    if preset is not None:
        if preset not in planner.PRESETS:
            raise ValueError(f"--preset {preset!r} is unknown; choose one of {', '.join(planner.PRESETS)}")
        shape = planner.PRESETS[preset]
    elif model_config is not None:
        shape = planner.shape_from_config(model_config)
    elif hidden_size is not None:
        shape = planner.ModelShape(hidden_size=hidden_size)
    else:
        raise ValueError("say what the target is: --preset, --model-config, or at least --hidden-size")
    overrides = {"hidden_size": hidden_size, "num_layers": num_layers,
                 "num_params": planner.params_from_billions(target_params) if target_params is not None else None}
    return shape.model_copy(update={k: v for k, v in overrides.items() if v is not None})


def planner_table(result: planner.Plan) -> Table:
    from dflash_core.units import binary_bytes, decimal_bytes

    table = Table(title="dflash plan (GiB/TiB = powers of 1024; TB = 10^12 bytes)", show_lines=False)
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_column("note")
    rows = [
        ("hidden-state bytes per token", f"{result.bytes_per_token:,}", "tapped layers x hidden x dtype"),
        ("offline storage (all tokens)", binary_bytes(result.offline_bytes), decimal_bytes(result.offline_bytes)),
        ("offline storage (anchors only)", binary_bytes(result.anchor_only_bytes),
         decimal_bytes(result.anchor_only_bytes)),
        ("online storage", binary_bytes(result.online_bytes), "hidden states never touch disk"),
        ("target parameters", f"{result.target_params / 1e9:.2f} B" if result.target_params else "unknown", ""),
        ("drafter parameters", f"{result.drafter_params / 1e9:.3f} B", "trainable, fp32 + AdamW"),
        ("target weights (bf16)", binary_bytes(result.target_weight_bytes) if result.target_weight_bytes else "?", ""),
        ("drafter weights+grads+AdamW", binary_bytes(result.drafter_state_bytes), "16 bytes/param"),
        ("target activations / batch", binary_bytes(result.target_activation_bytes), "estimate"),
        ("drafter activations / batch", binary_bytes(result.drafter_activation_bytes), "estimate"),
        *([("drafter_fp8 saves", binary_bytes(result.drafter_fp8_saved_bytes),
            "no bf16 copies of the drafter's linear weights and their gradients (measured)")]
          if result.drafter_fp8_saved_bytes else []),
        *([("lm_head_fp8 adds", binary_bytes(result.lm_head_fp8_bytes), "the LM head's two FP8 copies, drafter's GPU")]
          if result.lm_head_fp8_bytes else []),
        ("hidden-state transfer / batch", binary_bytes(result.transfer_bytes_per_batch),
         f"{result.transfer_ms_per_batch:.2f} ms (pair layout)"),
        ("generation wall time", f"{result.generation_hours:,.1f} h", "all samples, all instances"),
    ]
    for layout in result.layouts:
        verdict = {True: "[green]fits[/]", False: "[red]does not fit[/]", None: "[yellow]unknown[/]"}[layout.fits]
        rows.append((f"layout {layout.layout} ({layout.gpus_per_replica} GPU/replica, x{layout.replicas})",
                     binary_bytes(layout.peak_bytes_per_gpu) if layout.fits is not None else "?",
                     f"{verdict}: {layout.note}"))
    for row in rows:
        table.add_row(*row)
    return table


@services_app.command("up")
def services_up() -> None:
    """Start the local S3 server (SeaweedFS), the Prefect server and the stage server that runs every
    deployment (flows/serve.py); leave running ones alone."""
    from dflash_core.services import local
    from dflash_core.services.process import ServiceError

    settings = load_settings()
    for service in _services(settings):
        with console.status(f"starting {service.name} ..."):
            try:
                # A second `services up` at once waits for the first's start (a lock per service), then
                # finds the service running: one set of servers, and both commands succeed.
                status = local.start(service, on_wait=lambda line: console.print(f"[yellow]{line}[/]"))
            except ServiceError as error:
                raise _fail(str(error)) from None
        console.print(f"[green]{status.name}[/] running (pid {status.pid}) at {status.url}")


def _services(settings) -> list:
    from dflash_core.services import local
    from dflash_core.services.stages import stage_service

    return [*local.all_services(settings), stage_service(settings)]


@services_app.command("down")
def services_down() -> None:
    """Stop the local services this tool started (and nothing else)."""
    from dflash_core.services import local

    for service in reversed(_services(load_settings())):
        stopped = local.shutdown(service)
        console.print(f"{service.name}: {'stopped' if stopped else 'was not running'}")


@services_app.command("status")
def services_status() -> None:
    """Show whether each local service runs and answers its health check."""
    from dflash_core.services import local

    table = Table("service", "running", "healthy", "pid", "url", "log")
    for service in _services(load_settings()):
        s = local.status(service)
        table.add_row(s.name, str(s.running), str(s.healthy), str(s.pid or "-"), s.url, s.log_path)
    console.print(table)


@app.command()
def train(
    config: Annotated[Path, typer.Option(help="Run config (YAML or JSON): dflash_core.train.config.TrainConfig.")],
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Override a field: optim.lr=1e-4 (repeatable).")] = None,
    nproc_per_node: Annotated[int, typer.Option(help="Processes on this node: one per GPU (colocated) or per GPU "
                                                     "pair (placement=pair); >1 uses torchrun + DDP.")] = 1,
    resume: Annotated[bool, typer.Option(help="Continue from the latest complete checkpoint (local, else S3).")] = True,
    nnodes: Annotated[int, typer.Option(help="Nodes in the job; run this same command on each.")] = 1,
    rdzv_endpoint: Annotated[Optional[str], typer.Option(help="host:port every node reaches (c10d store, or the "
                                                              "static master).")] = None,
    rdzv_id: Annotated[Optional[str], typer.Option(help="c10d: job id, the same on every node.")] = None,
    rdzv_backend: Annotated[str, typer.Option(help="c10d (ranks assigned at rendezvous) or static "
                                                   "(--node-rank).")] = "c10d",
    node_rank: Annotated[Optional[int], typer.Option(help="static: this node's rank, 0 on the master.")] = None,
    pair_overlap: Annotated[bool, typer.Option(help="placement=pair: overlap the next batch's target forward "
                                                    "and transfer with this batch's drafter step.")] = False,
) -> None:
    """Train a drafter online (target forward + drafter step each batch; no hidden states on disk)."""
    from dflash_core.train.config import TrainConfig
    from dflash_core.train.entry import Rendezvous, training_argv

    overrides = [*(set_ or []), *(["pair_overlap=true"] if pair_overlap else [])]
    try:
        TrainConfig.from_yaml(config, overrides=overrides)  # fail here, with the field named, not in N processes
        rendezvous = Rendezvous(nnodes=nnodes, endpoint=rdzv_endpoint, job_id=rdzv_id, backend=rdzv_backend,
                                node_rank=node_rank)
    except UnicodeDecodeError as error:
        raise _fail(f"--config {config}: {not_utf8_text(error)}") from None
    except ValidationError as error:
        raise _fail(validation_summary(error)) from None
    except ValueError as error:
        raise _fail(str(error)) from None
    extra = [f"--set={item}" for item in overrides]
    argv = training_argv(config, nproc_per_node=nproc_per_node, resume=resume, extra=extra, rendezvous=rendezvous)
    from dflash_core.train.supervise import run_tied  # the run dies with this command (no orphan)

    raise typer.Exit(code=run_tied(argv))


@app.command()
def deploy(
    pool: Annotated[str, typer.Option(help="Process work pool to create (or reuse) for the deployments.")] = "dflash",
) -> None:
    """Create the process work pool and register every deployment (flows/deployment_table.py) in it, the
    way the stage server does at start (`flows.deployments.register_deployments`)."""
    from dflash_core.services.local import prefect_client_env

    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, **prefect_client_env(load_settings()), "DFLASH_REPO_DIR": str(repo)}
    register = ("import sys; from flows.deployments import register_deployments; "
                "print(*sorted(register_deployments(work_pool=sys.argv[1])), sep='\\n')")
    completed = subprocess.run([sys.executable, "-c", register, pool], env=env, cwd=repo, capture_output=True,
                               text=True)
    if completed.returncode != 0:
        raise _fail(f"registering the deployments failed:\n{completed.stdout[-2000:]}{completed.stderr[-2000:]}")
    console.print(completed.stdout.rstrip())
    console.print(f"registered in work pool {pool!r} at {load_settings().prefect_api_url}; start a worker with "
                  f"`{Path(sys.executable).parent / 'prefect'} worker start --pool {pool}`")


@app.command()
def demo() -> None:
    """Run the main job on the embedded default: local services up, then the pipeline as a deployment run."""
    services_up()
    run_flow("embedded-demo")


@app.command("run")
def run_flow(
    flow: Annotated[str, typer.Argument(help="A deployment name (embedded-demo, train-demo, ...) or a flow module "
                                             "under flows/ (pipeline, generate, tokenize, ...).")],
    params: Annotated[str, typer.Option(help="Flow parameters as JSON, or the path of a .json/.yaml file of them.")] = "{}",
) -> None:
    """Run a flow as a run of its deployment on the stage server (started if need be), so it and its
    stages can be retried from the UI; waits and prints its result (`python -m flows.launch`)."""
    from dflash_core.services import local
    from dflash_core.services.stages import result_store_env, stage_service

    params = _params_json(params)
    settings = load_settings()
    try:
        local.start(stage_service(settings))
    except local.ServiceError as error:
        raise _fail(f"{error} (is the Prefect server up? `dflash services up`)") from None
    env = {**os.environ, **local.prefect_client_env(settings), **result_store_env(settings)}
    process = subprocess.Popen([sys.executable, "-m", "flows.launch", flow, "--params", params], env=env,
                               stdout=subprocess.PIPE, text=True, bufsize=1)
    lines = []
    for line in process.stdout:  # echoed as it comes, kept for the summary
        sys.stdout.write(line)
        lines.append(line)
    returncode = process.wait()
    if flow in ("pipeline", "embedded-demo"):
        _print_summary(settings, lines)
    if returncode != 0:
        raise typer.Exit(code=returncode)


def _params_json(params: str) -> str:
    """`params` as JSON text: given inline, or read from a .json / .yaml file."""
    path = Path(params)
    if not params.lstrip().startswith("{") and path.suffix in (".json", ".yaml", ".yml"):
        if not path.is_file():
            raise _fail(f"--params {params}: no such file")
        import yaml

        try:
            return json.dumps(yaml.safe_load(path.read_text()) or {})
        except UnicodeDecodeError as error:
            raise _fail(f"--params {params}: {not_utf8_text(error)}") from None
        except yaml.YAMLError as error:
            raise _fail(f"--params {params}: not JSON or YAML ({error})") from None
    return params


def _print_summary(settings, launch_output: list[str]) -> None:
    """The pipeline's summary (dflash_core/run_summary.py): stages, tau and speedup, artifacts, UI links."""
    from dflash_core import run_summary

    flow_run_id, result = run_summary.parse_launch_output(launch_output)
    if flow_run_id is None:
        return
    try:
        stages = run_summary.read_stage_runs(settings.prefect_api_url, flow_run_id)
    except Exception as error:  # noqa: BLE001 - the run is over; a summary that cannot be read is not a failure
        Console(stderr=True).print(f"[yellow]no stage summary: {error}[/]")
        stages = []
    console.print(run_summary.summary(result, stages, title="dflash pipeline"))


if __name__ == "__main__":
    app()
