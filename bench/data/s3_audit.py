"""S3 audit at scale: plant a bucket of 20,000 objects on a local SeaweedFS, then time the audit (listing,
parallel manifest reads, optional sha256 HEADs, dead rules under the lineage safety rule) and the
confirmed cleanup, each in a child process whose peak RSS is measured. Goal on a 2-core machine:
the audit under 60 s and under 1 GiB.

    python -m bench.data.s3_audit [--objects 20000] [--workers 8]

The planted bucket: prompts -> completions -> two tokenizations (the older one superseded) -> checkpoints
(40 steps per run, keep 3; exports made from an older step, which lineage keeps) -> exports, reports; half the objects are unmanifested: dead hidden states
(abandoned; the audit runs 40 days "later") and strays beside live data. Object bodies are 256 bytes:
the audit's cost is per object, not per byte. A fresh server and bucket every run (temp dir).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

from dflash_core.layout import ArtifactKind
from dflash_core.lineage import InputRef, write_artifact
from dflash_core.settings import Settings, load_settings
from dflash_core.storage import ObjectStore, sha256_bytes

BODY = 256


def plan_bucket(total: int) -> tuple[list[dict], list[str]]:
    """Artifacts (with inputs, by index) and unmanifested keys; together `total` objects with manifests."""
    artifacts: list[dict] = []

    def add(kind: ArtifactKind, key: str, inputs: list[int]) -> int:
        artifacts.append({"kind": kind, "key": key, "inputs": inputs})
        return len(artifacts) - 1

    scale = total / 20_000
    n_shards = max(1, int(1000 * scale))
    prompts = [add(ArtifactKind.PROMPTS, f"prompts/bench/v1/prompts-{i:05d}.jsonl", []) for i in range(max(1, int(100 * scale)))]
    completions = [add(ArtifactKind.COMPLETIONS, f"completions/bench/run/shard-{i:05d}.jsonl", [prompts[i % len(prompts)]])
                   for i in range(n_shards)]
    for version in ("v1", "v2"):
        tokenized = [add(ArtifactKind.TOKENIZED, f"tokenized/bench/{version}/shard-{i:05d}.arrow", [completions[i]])
                     for i in range(n_shards)]
    for run in range(max(1, int(10 * scale))):
        exported = None
        for step in range(1, 41):
            for name in ("model.safetensors", "train_state.pt", "meta.json"):
                index = add(ArtifactKind.CHECKPOINT, f"checkpoints/run-{run:02d}/step-{step * 100:06d}/{name}",
                            tokenized[:5])
                exported = index if (step, name) == (30, "model.safetensors") else exported
        # Exported from step 3000, older than the 3 kept: the lineage rule must keep that file.
        for fmt in ("native", "speculators"):
            for f in range(5):
                add(ArtifactKind.EXPORT, f"exports/run-{run:02d}/{fmt}/file-{f}.bin", [exported])
    while 2 * len(artifacts) < total // 2:
        add(ArtifactKind.REPORT, f"reports/bench/r{len(artifacts):05d}/report.json", [completions[len(artifacts) % n_shards]])
    loose = total - 2 * len(artifacts)
    strays = loose // 5
    unmanifested = [f"hidden-states/qwen-27b/layer-{i % 64:02d}/part-{i:06d}.bin" for i in range(loose - strays)]
    unmanifested += [f"completions/bench/run/tmp-{i:05d}.partial" for i in range(strays)]
    return artifacts, unmanifested


def plant(store: ObjectStore, total: int, workers: int) -> tuple[int, float]:
    artifacts, unmanifested = plan_bucket(total)
    body = b"x" * BODY
    digest = sha256_bytes(body)
    uris = [store.uri(a["key"]) for a in artifacts]
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(lambda a: write_artifact(store, a["key"], body, kind=a["kind"],
                                               inputs=[InputRef(uri=uris[i], sha256=digest) for i in a["inputs"]]),
                      artifacts))
        list(pool.map(lambda key: store.put_bytes(key, body), unmanifested))
    return 2 * len(artifacts) + len(unmanifested), time.perf_counter() - start


def child(args: argparse.Namespace) -> None:
    """One measured operation in this (child) process; prints a JSON line."""
    from dflash_core.s3audit import Retention, audit, execute_cleanup

    settings = load_settings()
    store = ObjectStore.from_settings(settings)
    later = datetime.now(UTC) + timedelta(days=40)
    start = time.perf_counter()
    inventory, report, plan = audit(store, settings.s3_prefixes, retention=Retention(keep_checkpoints=3),
                                    verify_hashes=args.verify_hashes, workers=args.workers, now=later)
    audit_s = time.perf_counter() - start
    out = {"objects": report.objects, "manifests": report.manifests, "dead": report.dead_objects,
           "dead_by_rule": {r["rule"]: r["objects"] for r in report.dead_by_rule}, "protected": report.protected,
           "unmanifested": report.unmanifested, "audit_s": audit_s}
    if args.op == "cleanup":
        start = time.perf_counter()
        result = execute_cleanup(store, settings.s3_prefixes, plan, confirm=True, who="bench", workers=args.workers,
                                 known=inventory)
        out.update(cleanup_s=time.perf_counter() - start, deleted=len(result.deleted), failed=len(result.failed),
                   skipped=len(result.skipped))
    print(json.dumps(out))


def measure(op: str, env: dict[str, str], *, verify_hashes: bool, workers: int) -> dict:
    argv = [sys.executable, "-m", __spec__.name, "--child", op, "--workers", str(workers),
            *(["--verify-hashes"] if verify_hashes else [])]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    completed = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
    wall = time.perf_counter() - start
    if completed.returncode != 0:
        raise RuntimeError(f"{op} failed:\n{completed.stderr[-3000:]}")
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    # ru_maxrss of the children is the max over all waited-for children so far: only meaningful when it grew.
    result.update(wall_s=wall, peak_rss_mib=peak_kib / 1024 if peak_kib > before else None)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--objects", type=int, default=20_000)
    parser.add_argument("--workers", type=int, default=8, help="Threads for manifest reads and HEADs.")
    parser.add_argument("--child", choices=["audit", "cleanup"], help=argparse.SUPPRESS)
    parser.add_argument("--verify-hashes", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.op = args.child
        child(args)
        return

    from dflash_core.services import local
    from tests.conftest import free_port

    work = Path(tempfile.mkdtemp(prefix="dflash-bench-s3-"))
    settings = Settings(_env_file=None, s3_endpoint_url=f"http://127.0.0.1:{free_port(grpc_offset=True)}",
                        s3_bucket="bench", s3_access_key_id="bench-key", s3_secret_access_key="bench-secret-123456",
                        s3_master_port=free_port(grpc_offset=True), s3_volume_port=free_port(grpc_offset=True),
                        s3_filer_port=free_port(grpc_offset=True), s3_admin_port=free_port(grpc_offset=True),
                        work_dir=work)
    service = local.s3_service(settings)
    local.start(service)
    env = {**os.environ, "DFLASH_S3_ENDPOINT_URL": settings.s3_endpoint_url, "DFLASH_S3_BUCKET": settings.s3_bucket,
           "DFLASH_S3_ACCESS_KEY_ID": "bench-key", "DFLASH_S3_SECRET_ACCESS_KEY": "bench-secret-123456",
           "DFLASH_WORK_DIR": str(work)}
    try:
        store = ObjectStore.from_settings(settings)
        planted, plant_s = plant(store, args.objects, args.workers)
        print(f"planted {planted:,} objects in {plant_s:.1f} s ({planted / plant_s:,.0f}/s)", flush=True)
        rows = [("audit, sizes only", measure("audit", env, verify_hashes=False, workers=args.workers)),
                ("audit + sha256 HEAD per object", measure("audit", env, verify_hashes=True, workers=args.workers)),
                ("audit + confirmed cleanup", measure("cleanup", env, verify_hashes=False, workers=args.workers))]
    finally:
        local.shutdown(service)
    print(f"\n{args.objects:,} planted objects, {os.cpu_count()} cores, {args.workers} threads, SeaweedFS "
          f"`weed mini` on loopback ({datetime.now(UTC):%Y-%m-%d})\n")
    print("| run | objects | manifests | dead found | kept by lineage | audit s | cleanup s | deleted | "
          "process wall s | peak RSS MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in rows:
        rss = f"{r['peak_rss_mib']:,.0f}" if r["peak_rss_mib"] else "<= above"
        print(f"| {name} | {r['objects']:,} | {r['manifests']:,} | {r['dead']:,} | {r['protected']:,} | "
              f"{r['audit_s']:.1f} | {r.get('cleanup_s', 0):.1f} | {r.get('deleted', '-')} | {r['wall_s']:.1f} | {rss} |")
    print(f"\ndead by rule: {json.dumps(rows[0][1]['dead_by_rule'])}")
    print(f"reproduce: python -m bench.data.s3_audit --objects {args.objects} --workers {args.workers}")


if __name__ == "__main__":
    main()
