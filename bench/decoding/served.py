"""Several drafters served by the same vLLM on the same prompts: a target-only server, then one server per export
(ours, speculators', ...), each at temperature 0 at the given request concurrencies. Prints one table (engine tau,
tokens/s, speedup, outputs equal to target-only, per export and concurrency), writes it as JSON with every
pass's counters, and prints the command.

    python -m bench.decoding.served --python /tmp/dflash-node/vllm-venv/bin/python --target MODEL_DIR \\
        --export ours=EXPORT_DIR --export speculators=SPECULATORS_DIR --prompts heldout-00000.arrow --out OUT

An export is a directory vLLM loads as a DFlash draft (our native or speculators format, or speculators' own
`save_pretrained`); prompts are a tokenized Arrow shard (the prompt is what comes before the reply) or JSONL
with `input_ids`. Needs a GPU and vLLM (infra/node-install.sh with the vLLM parts).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path


def _args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", required=True, help="vLLM's interpreter (the node's vllm-venv/bin/python)")
    parser.add_argument("--target", required=True, help="the target's model dir")
    parser.add_argument("--export", action="append", required=True, metavar="NAME=DIR", help="a drafter (repeatable)")
    parser.add_argument("--prompts", required=True, type=Path, help="a tokenized .arrow shard or a .jsonl of input_ids")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-prompt-tokens", type=int, default=1024)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--port", type=int, default=8300)
    parser.add_argument("--out", type=Path, default=Path("served-bench"))
    return parser.parse_args(argv)


def _prompts(path: Path, *, num_prompts: int, max_prompt_tokens: int) -> list[list[int]]:
    from dflash_core.evaluate.inputs import prompts_from_jsonl, prompts_from_tokenized

    limits = {"num_prompts": num_prompts, "max_prompt_tokens": max_prompt_tokens}
    if path.suffix == ".arrow":
        return prompts_from_tokenized(path.read_bytes(), **limits)
    return prompts_from_jsonl(path.read_bytes(), tokenizer=None, **limits)


def main(argv: list[str] | None = None) -> None:
    from dflash_core.evaluate.served import compare_served, markdown_table, serve_and_measure
    from dflash_core.export.engines import speculative_config
    from dflash_core.serving.profiles import VllmProfile

    args = _args(argv)
    exports = dict(item.split("=", 1) for item in args.export)
    prompts = _prompts(args.prompts, num_prompts=args.num_prompts, max_prompt_tokens=args.max_prompt_tokens)
    engine = {"model": args.target, "python": args.python, "dtype": "bfloat16", "max_model_len": args.max_model_len,
              "gpu_memory_utilization": args.gpu_memory_utilization, "env": {"VLLM_USE_FLASHINFER_SAMPLER": "0"}}
    measure = {"port": args.port, "device": "0", "prompts": prompts, "max_new_tokens": args.max_new_tokens,
               "concurrencies": args.concurrency}
    args.out.mkdir(parents=True, exist_ok=True)
    target_only = serve_and_measure(VllmProfile(**engine), run_dir=args.out / "target-only", **measure)
    report = {"command": shlex.join([sys.executable, "-m", "bench.decoding.served", *(argv or sys.argv[1:])]),
              "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "exports": {}}
    for name, directory in exports.items():
        spec = speculative_config(directory)
        drafted = serve_and_measure(VllmProfile(**engine, speculative_config=spec), run_dir=args.out / name, **measure)
        report["exports"][name] = {"speculative_config": spec, **compare_served(target_only, drafted)}
        print(f"\n{name} ({directory})\n{markdown_table(report['exports'][name])}")
    (args.out / "served.json").write_text(json.dumps(report, indent=2))
    print(f"\n{len(prompts)} prompts x {args.max_new_tokens} tokens; {args.out / 'served.json'}\n{report['command']}")


if __name__ == "__main__":
    main()
