"""The mask token: the target embedding row every drafted slot of a block starts from.

It must be a row no real text uses, and never an end-of-sequence or end-of-turn token: SmolLM2's
pad token is `<|im_end|>` (its EOS), and masking with it gave ~2.5x the initial loss and ~3x the
gradient norm of an unused special token. The reference (z-lab) uses a row past the tokenizer's
vocabulary where the embedding has spare rows (Qwen3: 151,669 of 151,936).

    mask_id = resolve_mask_token_id(None, target_config=cfg, tokenizer=tok, token_counts=counts)

Choice, first that applies:
1. the tokenizer's own mask token, if it has one that is not an end token;
2. the first embedding row past the tokenizer's vocabulary (`len(tokenizer) < vocab_size`);
3. a special token the chat template never emits and the corpus never contains (reserved-named
   ones first, else the highest id): SmolLM2 -> 16 `<empty_output>`;
4. without a tokenizer: the highest row the corpus never contains, else the last row;
   never an end, BOS or pad token.
Pure Python: duck-typed configs and tokenizers, no torch.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

# Tokens that end a turn or a sequence in the families the field serves.
END_TOKEN_NAMES = (
    "<|im_end|>", "<|endoftext|>", "<|end_of_text|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "</s>",
    "<eos>", "<|end|>", "<|return|>", "<|END_OF_TURN_TOKEN|>", "<|end▁of▁sentence|>",
)
_PROBE_MESSAGES = [
    {"role": "system", "content": "s"},
    {"role": "user", "content": "u"},
    {"role": "assistant", "content": "a"},
    {"role": "user", "content": "u"},
]


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value if v is not None]


def _text(config: Any) -> Any:
    return getattr(config, "text_config", None) or config


def end_token_ids(target_config: Any, *, tokenizer: Any = None) -> dict[int, str]:
    """{id: name} of every end-of-sequence / end-of-turn token the target knows of (config EOS ids,
    the tokenizer's EOS, known end-token names, and a pad token that is one of those)."""
    text = _text(target_config)
    ends: dict[int, str] = {i: "eos_token_id" for i in _ids(getattr(text, "eos_token_id", None))}
    ends.update({i: "eos_token_id" for i in _ids(getattr(target_config, "eos_token_id", None))})
    if tokenizer is not None:
        ends.update({i: "eos_token" for i in _ids(getattr(tokenizer, "eos_token_id", None))})
        vocab = tokenizer.get_vocab()
        ends.update({vocab[name]: name for name in END_TOKEN_NAMES if name in vocab})
        for token_id in list(ends):
            name = tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(name, str):
                ends[token_id] = name
    return ends


def check_mask_token_id(mask_token_id: int, *, target_config: Any, tokenizer: Any = None) -> None:
    """ValueError when `mask_token_id` is not an embedding row or is an end token."""
    rows = int(_text(target_config).vocab_size)
    if not 0 <= mask_token_id < rows:
        raise ValueError(f"mask_token_id {mask_token_id} is not a row of the target's {rows}-row embedding")
    ends = end_token_ids(target_config, tokenizer=tokenizer)
    if mask_token_id in ends:
        raise ValueError(
            f"mask_token_id {mask_token_id} is the target's end token {ends[mask_token_id]!r}: every drafted slot "
            "would start from an end-of-turn embedding (SmolLM2 measured ~2.5x initial loss). Leave mask_token_id "
            "unset to pick an unused row"
        )


def _template_ids(tokenizer: Any) -> set[int]:
    """Ids a rendered chat (system, user, assistant turns, generation prompt) contains."""
    if not getattr(tokenizer, "chat_template", None):
        return set()
    try:
        rendered = tokenizer.apply_chat_template(_PROBE_MESSAGES, tokenize=True, add_generation_prompt=True)
    except Exception as error:  # templates are user code: a failing one only loses this filter
        warnings.warn(f"could not render the chat template to find the tokens it uses ({error})", stacklevel=3)
        return set()
    if isinstance(rendered, dict) or hasattr(rendered, "keys"):
        rendered = rendered["input_ids"]
    return set(_ids(rendered))


def _special_candidates(tokenizer: Any, *, excluded: set[int], rows: int) -> list[tuple[int, str]]:
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    found = []
    for token_id, token in decoder.items():
        name = str(getattr(token, "content", token))
        if getattr(token, "special", True) and 0 <= token_id < rows and token_id not in excluded:
            found.append((int(token_id), name))
    return sorted(found)


def choose_mask_token_id(target_config: Any, *, tokenizer: Any = None,
                         token_counts: Sequence[int] | None = None) -> int:
    """The mask row for a target (see the module docstring for the order of choices)."""
    text = _text(target_config)
    rows = int(text.vocab_size)
    ends = end_token_ids(target_config, tokenizer=tokenizer)
    excluded = set(ends) | set(_ids(getattr(text, "bos_token_id", None)))
    excluded |= set(_ids(getattr(text, "pad_token_id", None)))

    def unused(token_id: int) -> bool:
        return token_counts is None or token_id >= len(token_counts) or token_counts[token_id] == 0

    if tokenizer is not None:
        excluded |= set(_ids(getattr(tokenizer, "bos_token_id", None)))
        excluded |= set(_ids(getattr(tokenizer, "pad_token_id", None)))
        own = getattr(tokenizer, "mask_token_id", None)
        if isinstance(own, int) and 0 <= own < rows and own not in excluded and unused(own):
            return own
        if len(tokenizer) < rows:
            return len(tokenizer)
        excluded |= _template_ids(tokenizer)
        specials = [(i, name) for i, name in _special_candidates(tokenizer, excluded=excluded, rows=rows)
                    if unused(i)]
        reserved = [i for i, name in specials if "reserved" in name.lower()]
        if reserved:
            return reserved[0]
        if specials:
            return specials[-1][0]
    for token_id in range(rows - 1, -1, -1):
        if token_id not in excluded and unused(token_id):
            return token_id
    raise ValueError(f"no usable mask row among the target's {rows} embedding rows")


def resolve_mask_token_id(requested: int | None, *, target_config: Any, tokenizer: Any = None,
                          token_counts: Sequence[int] | None = None) -> int:
    """`requested` after checking it (ValueError for an end token), else the chosen row."""
    if requested is not None:
        check_mask_token_id(requested, target_config=target_config, tokenizer=tokenizer)
        if token_counts is not None and requested < len(token_counts) and token_counts[requested]:
            warnings.warn(f"mask_token_id {requested} occurs {int(token_counts[requested])} times in the training "
                          "data: the drafter cannot tell masked slots from that token", stacklevel=2)
        return requested
    return choose_mask_token_id(target_config, tokenizer=tokenizer, token_counts=token_counts)
