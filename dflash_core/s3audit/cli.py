"""`dflash s3 audit|cleanup` and `dflash lineage list|show`: the bucket's inventory, its dead data, and
where any artifact came from and what it fed."""

from __future__ import annotations

import getpass
import json
import os
import platform
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.tree import Tree

from dflash_core.units import binary_bytes

s3_app = typer.Typer(help="Audit the bucket (inventory, dead data) and clean it up safely.", no_args_is_help=True)
lineage_app = typer.Typer(help="Lineage rebuilt from manifests: what made an artifact, what it fed.",
                          no_args_is_help=True)
WIDE_COLUMNS = 250  # the width when stdout is not a terminal (a pipe, a file): rich would cut tables to 80


def _console() -> Console:
    """Where results are printed: a terminal's own width; a pipe or file gets WIDE_COLUMNS unless COLUMNS says
    otherwise, so a table's URIs stay whole on one line."""
    narrow = sys.stdout.isatty() or os.environ.get("COLUMNS")
    return Console(width=None if narrow else WIDE_COLUMNS)

PrefixOpt = Annotated[str, typer.Option(help="Audit / nominate only keys under this prefix (lineage always "
                                             "spans the whole bucket).")]
KeepCkptOpt = Annotated[int, typer.Option(help="Newest checkpoint steps kept per run.")]
AbandonedOpt = Annotated[float, typer.Option(help="Days without change after which a prefix with no manifests "
                                                  "is abandoned.")]
KeepPrefixOpt = Annotated[Optional[list[str]], typer.Option(help="Never nominate keys under this prefix "
                                                                  "(repeatable).")]
PrefectResultsOpt = Annotated[Optional[float], typer.Option(
    help="Prefect's persisted results (prefect-results/, its task cache) older than this many days are cleanup "
         "candidates. Unset: kept forever.")]


def _fail(message: str) -> typer.Exit:
    Console(stderr=True).print(f"[bold red]error:[/] {message}")
    return typer.Exit(code=2)


def _store():
    from dflash_core.settings import load_settings
    from dflash_core.storage import ObjectStore

    settings = load_settings()
    store = ObjectStore.from_settings(settings)
    store.check()
    return settings, store


def _retention(keep_checkpoints: int, abandoned_after_days: float, keep_prefix: list[str] | None,
               prefect_results_days: float | None = None):
    from dflash_core.s3audit import Retention

    return Retention(keep_checkpoints=keep_checkpoints, abandoned_after_days=abandoned_after_days,
                     keep_prefixes=keep_prefix or [], prefect_results_days=prefect_results_days)


@s3_app.command("audit")
def audit_command(
    prefix: PrefixOpt = "",
    keep_checkpoints: KeepCkptOpt = 3,
    abandoned_after_days: AbandonedOpt = 30.0,
    keep_prefix: KeepPrefixOpt = None,
    prefect_results_days: PrefectResultsOpt = None,
    verify_hashes: Annotated[bool, typer.Option(help="HEAD every manifested object to compare sha256.")] = True,
    markdown: Annotated[Optional[Path], typer.Option(help="Also write the markdown summary here.")] = None,
    png: Annotated[Optional[Path], typer.Option(help="Also write the bytes-per-kind chart here.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Objects, bytes, age per kind and prefix; unmanifested objects; broken manifests; dead data (dry run)."""
    from dflash_core.s3audit import audit, audit_markdown, bytes_by_kind_png
    from dflash_core.storage import StoreError

    try:
        settings, store = _store()
        _, report, plan = audit(store, settings.s3_prefixes, prefix=prefix, verify_hashes=verify_hashes,
                                retention=_retention(keep_checkpoints, abandoned_after_days, keep_prefix,
                                                     prefect_results_days))
    except (StoreError, ValueError) as error:
        raise _fail(str(error)) from None
    if markdown:
        markdown.write_text(audit_markdown(report, plan))
    if png:
        png.write_bytes(bytes_by_kind_png(report))
    if as_json:
        print(report.model_dump_json(indent=2))
        return
    console = _console()
    table = Table("kind", "objects", "size", "unmanifested", "oldest", "newest",
                  title=f"{report.store_uri}: {report.objects:,} objects, {binary_bytes(report.bytes)} "
                        f"({report.seconds:.1f} s)")
    for row in report.by_kind:
        table.add_row(row["kind"], f"{row['objects']:,}", binary_bytes(row["bytes"]), f"{row['unmanifested']:,}",
                      str(row["oldest"])[:10], str(row["newest"])[:10])
    console.print(table)
    console.print(f"dead: [bold]{report.dead_objects:,} objects, {binary_bytes(report.dead_bytes)}[/] ("
                  + ", ".join(f"{r['rule']} {binary_bytes(r['bytes'])}" for r in report.dead_by_rule)
                  + f"); {report.protected} nominated but referenced by live data")
    console.print(f"unmanifested {report.unmanifested:,} ({binary_bytes(report.unmanifested_bytes)}), manifests "
                  f"without object {len(report.orphan_manifests)}, objects differing from their manifest "
                  f"{len(report.hash_problems)}, unreadable manifests {len(report.unreadable_manifests)}, incomplete "
                  f"multipart uploads {len(report.incomplete_uploads)}")
    console.print("`dflash s3 cleanup` shows what a cleanup would delete; add --confirm to delete it.")


@s3_app.command("cleanup")
def cleanup_command(
    prefix: PrefixOpt = "",
    keep_checkpoints: KeepCkptOpt = 3,
    abandoned_after_days: AbandonedOpt = 30.0,
    keep_prefix: KeepPrefixOpt = None,
    prefect_results_days: PrefectResultsOpt = None,
    confirm: Annotated[bool, typer.Option("--confirm", help="Delete. Without it this is a dry run.")] = False,
    show: Annotated[int, typer.Option(help="Candidates listed.")] = 50,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan (or the result) as JSON.")] = False,
) -> None:
    """Dry run by default: what would go, bytes reclaimed, why. --confirm re-checks and deletes."""
    from dflash_core.provenance import current_producer
    from dflash_core.s3audit import execute_cleanup, plan_cleanup, take_inventory, write_deletion_record
    from dflash_core.storage import StoreError

    try:
        settings, store = _store()
        inventory = take_inventory(store, settings.s3_prefixes, verify_hashes=False)
        plan = plan_cleanup(inventory, _retention(keep_checkpoints, abandoned_after_days, keep_prefix,
                                                  prefect_results_days), prefix=prefix)
    except (StoreError, ValueError) as error:
        raise _fail(str(error)) from None
    console = _console()
    if not confirm:
        if as_json:
            print(plan.model_dump_json(indent=2))
            return
        table = Table("key", "size", "why", title=f"dry run: {len(plan.candidates):,} objects, "
                                                 f"{binary_bytes(plan.total_bytes)} would be deleted")
        for c in plan.candidates[:show]:
            table.add_row(c.key, binary_bytes(c.bytes), c.reason)
        console.print(table)
        if len(plan.candidates) > show:
            console.print(f"... and {len(plan.candidates) - show:,} more (--show N, or --json)")
        for p in plan.protected[:show]:
            console.print(f"[green]kept[/] {p.key}: {p.kept_because} (nominated: {p.nominated_because})")
        console.print("nothing was deleted; run again with --confirm to delete these (re-checked first)")
        return
    who = f"{getpass.getuser()}@{platform.node()}"
    try:
        result = execute_cleanup(store, settings.s3_prefixes, plan, confirm=True, who=who, known=inventory)
        record = write_deletion_record(store, settings.s3_prefixes, result, producer=current_producer())
    except StoreError as error:
        raise _fail(str(error)) from None
    if as_json:
        print(result.model_dump_json(indent=2))
    else:
        console.print(f"deleted {len(result.deleted):,} objects ({binary_bytes(result.bytes_reclaimed)}); "
                      f"skipped {len(result.skipped):,}; failed {len(result.failed):,}; record {record.uri}")
        for outcome in result.skipped[:show]:
            console.print(f"[yellow]skipped[/] {outcome.key}: {outcome.detail}")
        for outcome in result.failed:
            console.print(f"[red]failed[/] {outcome.key}: {outcome.detail}")
    if result.failed:
        raise typer.Exit(code=1)


@lineage_app.command("list")
def lineage_list(
    prefix: Annotated[str, typer.Argument(help="Key prefix to rebuild lineage for ('' = whole bucket).")] = "",
    as_json: Annotated[bool, typer.Option("--json", help="Print the graph as JSON.")] = False,
) -> None:
    """Rebuild the lineage graph from manifests and list objects that have no manifest."""
    from dflash_core.lineage import build_lineage, find_unmanifested
    from dflash_core.storage import StoreError

    try:
        _, store = _store()
        graph = build_lineage(store, prefix)
        orphans = find_unmanifested(store, prefix)
    except StoreError as error:
        raise _fail(str(error)) from None
    if as_json:
        print(json.dumps({**graph.to_dict(), "unmanifested": [o.key for o in orphans]}, indent=2))
        return
    console = _console()
    table = Table("artifact", "kind", "bytes", "inputs", title=f"lineage of {store.uri(prefix)}")
    for uri, manifest in sorted(graph.manifests.items()):
        table.add_row(uri, str(manifest.kind), f"{manifest.bytes:,}", "\n".join(sorted(graph.inputs_of(uri))) or "-")
    console.print(table)
    if orphans:
        console.print(f"[yellow]{len(orphans)} object(s) without a manifest:[/]")
        for info in orphans[:50]:
            console.print(f"  {store.uri(info.key)} ({info.size:,} bytes)")


@lineage_app.command("show")
def lineage_show(
    uri: Annotated[str, typer.Argument(help="s3://bucket/key of an artifact, or its key.")],
    depth: Annotated[int, typer.Option(help="Levels walked up and down.")] = 10,
    as_json: Annotated[bool, typer.Option("--json", help="Print as JSON (for scripts).")] = False,
) -> None:
    """What made URI (flow run and its UI link, code version, inputs with hashes, config) and what it fed."""
    from dflash_core.lineage import LineageGraph
    from dflash_core.lineage_views import describe
    from dflash_core.s3audit import take_inventory
    from dflash_core.storage import StoreError

    try:
        settings, store = _store()
        graph = LineageGraph(take_inventory(store, settings.s3_prefixes, verify_hashes=False).manifests.values())
        uri = uri if uri.startswith("s3://") else store.uri(uri)
        if not uri.startswith(store.uri("")):
            raise ValueError(f"{uri} is not in the configured bucket {store.uri('')} (DFLASH_S3_BUCKET)")
        info = describe(graph, uri, ui_base=settings.prefect_api_url, depth=depth)
    except (StoreError, ValueError) as error:
        raise _fail(str(error)) from None
    except KeyError as error:
        raise _fail(str(error.args[0])) from None
    if as_json:
        print(json.dumps(info, indent=2))
        return
    _console().print(_show_tree(info))


def _show_tree(info: dict) -> Tree:
    manifest = info["manifest"]
    if manifest is None:
        root = Tree(f"[bold]{info['uri']}[/] [yellow](no manifest: only known as an input)[/]")
    else:
        producer = manifest["producer"]
        root = Tree(f"[bold]{info['uri']}[/]  {manifest['kind']}, {binary_bytes(manifest['bytes'])}, "
                    f"sha256 {manifest['sha256'][:16]}..., {manifest['created_at']}")
        made = root.add("[bold]made by[/]")
        made.add(f"flow run {producer.get('flow_run_id') or '-'}"
                 + (f"  {info['flow_run_url']}" if info["flow_run_url"] else "")
                 + f"; task run {producer.get('task_run_id') or '-'}")
        made.add(f"code: git {producer.get('git_sha') or '?'}, dflash-pipeline {producer.get('package_version') or '?'}"
                 f", host {producer.get('host') or '?'}")
        if producer.get("argv"):
            made.add("argv: " + " ".join(producer["argv"])[:300])
        config = json.dumps(manifest["config"], sort_keys=True)
        made.add("config: " + (config if len(config) <= 400 else config[:400] + " ..."))
    _add_nodes(root.add("[bold]inputs[/] (what made it)"), info["inputs"], inputs=True)
    _add_nodes(root.add("[bold]fed[/] (what was made from it)"), info["fed"], inputs=False)
    return root


def _add_nodes(branch: Tree, nodes: list[dict], *, inputs: bool) -> None:
    if not nodes:
        branch.add("[dim]none[/]")
    for node in nodes:
        sha = node["recorded_sha256"] if inputs else node["sha256"]
        status = "" if node["status"] == "ok" else f" [yellow]({node['status']})[/]"
        child = branch.add(f"{node['uri']}  {node['kind'] or '?'}"
                           + (f", sha256 {sha[:16]}..." if sha else "") + status)
        for grandchild in node["children"]:
            _add_nodes(child, [grandchild], inputs=inputs)
