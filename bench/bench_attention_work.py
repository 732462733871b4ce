"""How much attention work the drafter's training step asks of the GPU with each attention backend, on the
acceptance bench's packed rows (issue #45): the dense SDPA path (`attention_backend: sdpa`, what
bench_acceptance trained with before session 28) computes every (query slot, key) pair of the row, the flex
path only the 128 x 128 blocks its BlockMask keeps. Counted on this machine's CPU, no GPU needed.

Rows: the bench's 8,192-token rows packed from its carried completions (.carry/acceptance/completions/, one
chunk is plenty), or with --doc-len N rows of N-token documents (what bench_train_e2e's --sample-len packs).
For each anchor count: the query slots and keys, the share of pairs the mask allows and of blocks flex visits,
the attention TFLOP a step (2 drafter layers, forward + backward = 3x forward) dense and flex, and the rest
of the step's useful TFLOP (bench_train_step.step_flops_parts: target linears, teacher head, drafter linears,
the loss's LM head) for scale.

    .venv/bin/python bench/bench_attention_work.py [--anchors 512 2048] [--doc-len 256]
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import statistics
import sys
import warnings
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from acceptance_completions import training_corpus  # noqa: E402
from bench_train_step import step_flops_parts  # noqa: E402
from dflash_core.model import DFlashConfig, plan_blocks  # noqa: E402
from dflash_core.model.masks import create_flex_block_mask, dense_mask  # noqa: E402
from dflash_core.target import real_shape_config  # noqa: E402
from dflash_core.train.data import PackedBatchSampler, TokenizedCorpus, collate  # noqa: E402

import numpy as np  # noqa: E402


def corpus_from(args) -> tuple[TokenizedCorpus, str]:
    if args.doc_len:
        count = 8 * args.token_budget // args.doc_len
        tokens = np.ones(count * args.doc_len, dtype=np.uint32)
        loss = np.tile((np.arange(args.doc_len) >= args.doc_len // 8).astype(np.uint8), count)
        offsets = np.arange(count + 1, dtype=np.int64) * args.doc_len
        return TokenizedCorpus(tokens=tokens, loss_mask=loss, offsets=offsets,
                               names=tuple(map(str, range(count)))), f"documents of {args.doc_len} tokens"
    chunks = sorted(glob.glob(str(args.completions / "chunk-*.json.gz")))
    if not chunks:
        raise SystemExit(f"no completion chunks in {args.completions}: carry them (bench_acceptance.py's docstring) "
                         "or pass --doc-len N for rows of N-token documents")
    records = json.loads(gzip.open(chunks[0]).read())
    return training_corpus(records), f"the bench's completions ({Path(chunks[0]).name}, {len(records):,} documents)"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--completions", type=Path, default=Path(".carry/acceptance/completions"))
    parser.add_argument("--doc-len", type=int, default=None)
    parser.add_argument("--token-budget", type=int, default=8192)
    parser.add_argument("--anchors", type=int, nargs="+", default=[512, 2048],
                        help="anchors a row (the bench's default: 2,048 on an 8,192-token row; speculators' 512)")
    parser.add_argument("--rows", type=int, default=4)
    args = parser.parse_args(argv)
    corpus, source = corpus_from(args)
    target = real_shape_config("smollm2-135m")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = DFlashConfig.from_target(target, num_layers=2, block_size=8)
    heads, head_dim = config.num_attention_heads, config.head_dim
    sampler = iter(PackedBatchSampler(corpus.lengths, token_budget=args.token_budget, seed=0))
    batches = [collate(corpus, next(sampler), token_budget=args.token_budget) for _ in range(args.rows)]
    print(f"{args.rows} rows of {args.token_budget:,} tokens from {source}; drafter: 2 layers, {heads} heads of "
          f"{head_dim}, block 8 (random SmolLM2 shape)\n")
    print("| anchors | query slots x keys | docs a row | pairs allowed | blocks flex visits | attention TFLOP dense "
          "| attention TFLOP flex | rest of the step TFLOP |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    rows = []
    for anchors in args.anchors:
        allowed, visited, docs = [], [], []
        for step, batch in enumerate(batches):
            host = {name: torch.from_numpy(getattr(batch, name))[None] for name in ("position_ids", "loss_mask")}
            plan = plan_blocks(loss_mask_BT=host["loss_mask"], num_anchors=anchors, block_size=8,
                               position_ids_BT=host["position_ids"], generator=torch.Generator().manual_seed(step))
            allowed.append(dense_mask(plan).float().mean().item())
            visited.append(1 - create_flex_block_mask(plan, compile_mask=False).sparsity() / 100)
            docs.append(int(plan.document_ids.max()) + 1)
        queries, keys = anchors * 8, args.token_budget + anchors * 8
        dense = 3 * config.num_layers * 4 * queries * keys * heads * head_dim / 1e12
        parts = step_flops_parts(target_config=target, config=config, plans=[plan], batch=1,
                                 seq_len=args.token_budget)
        rest = sum(value for name, value in parts.items() if not name.endswith("attention")) / 1e12
        row = {"anchors": anchors, "queries": queries, "keys": keys, "documents": statistics.mean(docs),
               "allowed": statistics.mean(allowed), "flex_visits": statistics.mean(visited),
               "dense_tflop": dense, "flex_tflop": dense * statistics.mean(visited), "rest_tflop": rest}
        rows.append(row)
        print(f"| {anchors:,} | {queries:,} x {keys:,} | {row['documents']:.0f} | {100 * row['allowed']:.2f}% | "
              f"{100 * row['flex_visits']:.2f}% | {dense:.2f} | {row['flex_tflop']:.2f} | {rest:.2f} |")
    print("\n(attention: 2 drafter layers, forward + backward = 3x the forward's 4 x Q x K x heads x head_dim; the "
          "rest: the target's linears, the teacher's head, the drafter's linears and its loss's LM head)")
    print("reproduce: .venv/bin/python bench/bench_attention_work.py " + " ".join(sys.argv[1:] if argv is None else argv))
    return rows


if __name__ == "__main__":
    main()
