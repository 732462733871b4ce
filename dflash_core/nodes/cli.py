"""`dflash node provision|preserve`: the node stages from a shell, no Prefect server needed.

Also `python -m dflash_core.nodes provision --local ...` (the same commands), for a bare GPU machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from dflash_core.nodes.access import NodeError
from dflash_core.nodes.node import Node, find_node, local_node
from dflash_core.units import binary_bytes

node_app = typer.Typer(help="Provision a node, or preserve it before shutdown (local or over SSH).",
                       no_args_is_help=True, pretty_exceptions_show_locals=False, add_completion=False)
console = Console()

LocalOpt = Annotated[bool, typer.Option("--local", help="This machine (no SSH).")]
NodeOpt = Annotated[Optional[str], typer.Option("--node", help="Node name in the inventory file.")]
InventoryOpt = Annotated[Path, typer.Option(help="Node inventory (YAML, top-level `nodes:`).",
                                            envvar="DFLASH_NODES_FILE")]
WorkDirOpt = Annotated[Optional[str], typer.Option(help="Node work dir (with --local; default: <work_dir>/node).")]


def _fail(message: str) -> typer.Exit:
    Console(stderr=True).print(f"[bold red]error:[/] {message}")
    return typer.Exit(code=2)


def _resolve_node(local: bool, node: str | None, inventory: Path, work_dir: str | None, gpus: int | None) -> Node:
    if local == (node is not None):
        raise ValueError("say which node: --local (this machine) or --node NAME (from --inventory)")
    if local:
        if work_dir is None:
            from dflash_core.settings import load_settings

            work_dir = str(load_settings().work_path("node"))
        return local_node(work_dir, name="local", gpus=gpus)
    found = find_node(inventory, node or "")
    changes = {k: v for k, v in {"work_dir": work_dir, "gpus": gpus}.items() if v is not None}
    return Node.model_validate({**found.model_dump(), **changes})


@node_app.command()
def provision(
    local: LocalOpt = False,
    node: NodeOpt = None,
    inventory: InventoryOpt = Path("nodes.yaml"),
    work_dir: WorkDirOpt = None,
    gpus: Annotated[Optional[int], typer.Option(help="Fail unless at least this many GPUs are visible.")] = None,
    venv_dir: Annotated[Optional[str], typer.Option(help="Venv path (default <work_dir>/venv); never on a "
                                                         "network filesystem.")] = None,
    python: Annotated[str, typer.Option(help="Interpreter that creates the venv.")] = "python3",
    system_site_packages: Annotated[bool, typer.Option(help="Venv sees the image's packages (its CUDA torch).")] = False,
    package: Annotated[Optional[list[str]], typer.Option(help="Requirement to install (repeatable).")] = None,
    gpu_extra: Annotated[bool, typer.Option(help="Install the project's `gpu` extra (pinned in pyproject.toml).")] = False,
    requirements: Annotated[Optional[list[str]], typer.Option(
        "--requirements", "-r", help="Requirement file on the node (pip -r; repeatable).")] = None,
    editable: Annotated[Optional[list[str]], typer.Option(
        "--editable", "-e", help="Project checkout on the node installed editable (pip -e; repeatable).")] = None,
    find_links: Annotated[Optional[list[str]], typer.Option(help="Wheelhouse dir on the node (repeatable).")] = None,
    no_index: Annotated[bool, typer.Option(help="Install only from --find-links (offline node).")] = False,
    no_deps: Annotated[bool, typer.Option(help="pip --no-deps.")] = False,
    model_dir: Annotated[Optional[str], typer.Option(help="Target model dir on the node (RAM-disk placement).")] = None,
    ram_disk: Annotated[str, typer.Option(help="RAM disk for a slow model home.")] = "/dev/shm",
    ram_disk_below_mb_s: Annotated[float, typer.Option(help="Copy the model when its home reads slower (MB/s).")] = 1500.0,
    read_sample_mb: Annotated[int, typer.Option(help="MB read to measure the model home.")] = 512,
    upload: Annotated[bool, typer.Option(help="Register the node record in S3 (node-backups/<node>/<time>/).")] = True,
    record_out: Annotated[Optional[Path], typer.Option(help="Also write the node record here (JSON).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the node record as JSON.")] = False,
) -> None:
    """Provision idempotently: venv on local disk + packages, GPU and disk checks, model on a RAM disk if slow."""
    from dflash_core.nodes.provision import ProvisionConfig, provision as run_provision, write_node_record

    try:
        target = _resolve_node(local, node, inventory, work_dir, gpus)
        config = ProvisionConfig(venv_dir=venv_dir, python=python, system_site_packages=system_site_packages,
                                 packages=package or [], gpu_extra=gpu_extra, requirements=requirements or [],
                                 editable=editable or [], find_links=find_links or [],
                                 no_index=no_index,
                                 no_deps=no_deps, model_dir=model_dir, ram_disk=ram_disk,
                                 ram_disk_below_mb_s=ram_disk_below_mb_s, read_sample_mb=read_sample_mb)
        with target.connect() as access:
            record = run_provision(access, target, config)
            path = write_node_record(access, target.work_dir, record)
    except (ValueError, NodeError) as error:
        raise _fail(str(error)) from None
    if record_out is not None:
        record_out.parent.mkdir(parents=True, exist_ok=True)
        record_out.write_text(record.model_dump_json(indent=2))
    uri = None
    if upload:
        uri = _upload_record(record)
    if as_json:
        print(record.model_dump_json(indent=2))
        return
    console.print(_record_table(record, on_node=path, uri=uri))


def _upload_record(record) -> str:
    from dflash_core.nodes.provision import upload_node_record
    from dflash_core.provenance import current_producer
    from dflash_core.settings import load_settings
    from dflash_core.storage import ObjectStore, StoreError

    settings = load_settings()
    try:
        store = ObjectStore.from_settings(settings)
        store.check()
        return upload_node_record(store, settings.s3_prefixes, record, producer=current_producer()).uri
    except StoreError as error:
        raise _fail(f"{error}\n(the node is provisioned; pass --no-upload to skip registering its record)") from None


def _record_table(record, *, on_node: str, uri: str | None) -> Table:
    table = Table("what", "value", title=f"node {record.node} ({record.hostname}) in {record.seconds:.1f} s")
    table.add_row("changed", "\n".join(record.actions) or "nothing (already provisioned)")
    table.add_row("venv", f"{record.venv.path} ({record.venv.fs_type} at {record.venv.mount_point}), Python "
                          f"{record.venv.python}, {len(record.venv.freeze)} packages")
    gpus = "\n".join(f"{g.index}: {g.name}, {g.memory_mib:,} MiB, driver {g.driver}" for g in record.gpus.gpus)
    table.add_row("GPUs", (gpus + f"\nCUDA {record.gpus.cuda_version}") if gpus else record.gpus.note)
    for disk in record.disks:
        table.add_row(f"disk {disk.path}", f"{disk.fs_type} at {disk.mount_point}: {binary_bytes(disk.free_bytes)} "
                                           f"free of {binary_bytes(disk.total_bytes)}")
    if record.model:
        m = record.model
        table.add_row("model", f"{m.source} ({m.source_fs_type}, {binary_bytes(m.bytes)}, {m.num_files} files) reads "
                               f"{m.read_mb_s:,.0f} MB/s\n-> {m.placed_at}: {m.reason}")
    table.add_row("record", on_node + (f"\n{uri}" if uri else ""))
    return table


@node_app.command()
def preserve(
    local: LocalOpt = False,
    node: NodeOpt = None,
    inventory: InventoryOpt = Path("nodes.yaml"),
    work_dir: WorkDirOpt = None,
    scripts: Annotated[Optional[list[str]], typer.Option(help="Scripts to save (relative to work dir); repeatable.")] = None,
    logs: Annotated[Optional[list[str]], typer.Option(help="Logs to save; repeatable.")] = None,
    configs: Annotated[Optional[list[str]], typer.Option(help="Configs to save; repeatable.")] = None,
    stop_servers: Annotated[bool, typer.Option(help="Stop the processes recorded in <work_dir>/pids first.")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Before shutdown: stop our servers, upload scripts, logs, configs and a system inventory to S3, write a note."""
    from dflash_core.nodes.preserve import PreserveConfig, preserve as run_preserve
    from dflash_core.provenance import current_producer
    from dflash_core.settings import load_settings
    from dflash_core.storage import ObjectStore, StoreError

    defaults = PreserveConfig()
    config = PreserveConfig(scripts=scripts or defaults.scripts, logs=logs or defaults.logs,
                            configs=configs or defaults.configs, stop_servers=stop_servers)
    settings = load_settings()
    try:
        target = _resolve_node(local, node, inventory, work_dir, None)
        store = ObjectStore.from_settings(settings)
        store.check()
        with target.connect() as access:
            result = run_preserve(access, target, store, settings.s3_prefixes, config, producer=current_producer())
    except (ValueError, NodeError, StoreError) as error:
        raise _fail(str(error)) from None
    if as_json:
        print(result.model_dump_json(indent=2))
        return
    console.print(result.note_markdown)
    console.print(f"[green]saved[/] under {result.prefix_uri} (note: {result.note_uri})")


def main() -> None:
    node_app(prog_name="python -m dflash_core.nodes")


if __name__ == "__main__":
    main()
