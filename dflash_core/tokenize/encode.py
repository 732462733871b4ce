"""Batch-encode rendered conversations with the fast tokenizer and turn character spans into token spans.

One `encode_batch` call per chunk; boundaries come from the encodings' character offsets
(`char_to_token`), never from a second tokenization of the whole prompt. Prefix stability is
checked exactly but cheaply: added (control) tokens split text before the model sees it, so the
prompt's tokens equal the full conversation's first tokens iff no token straddles the boundary
and the text after the prompt's last control token (e.g. "assistant\\n") encodes alone to the same
tokens it has inside the conversation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflash_core.tokenize.render import PrefixUnstable, RenderedSample
from dflash_core.tokenize.target import TargetTokenizer


@dataclass(slots=True)
class EncodedSample:
    ids: np.ndarray  # uint32, the whole conversation
    loss_start: int  # token index of the first loss token
    loss_end: int  # one past the last loss token


class TailEncoder:
    """Encodes the short prompt tails the stability check compares, caching them by text."""

    def __init__(self, target: TargetTokenizer, *, max_entries: int = 4096):
        self.target = target
        self.cache: dict[str, list[int]] = {}
        self.max_entries = max_entries

    def __call__(self, text: str) -> list[int]:
        ids = self.cache.get(text)
        if ids is None:
            ids = self.target.tokenizer.encode(text, add_special_tokens=False).ids
            if len(self.cache) < self.max_entries:
                self.cache[text] = ids
        return ids


def encode_samples(rendered: list[RenderedSample], *, target: TargetTokenizer,
                   tails: TailEncoder) -> list[EncodedSample | PrefixUnstable]:
    """Token ids and loss spans of each rendered sample, or the reason its prompt tokens are unstable."""
    encodings = target.tokenizer.encode_batch([sample.text for sample in rendered], add_special_tokens=False)
    return [_spans(sample, encoding, tails) for sample, encoding in zip(rendered, encodings)]


def _spans(sample: RenderedSample, encoding, tails: TailEncoder) -> EncodedSample | PrefixUnstable:
    ids = encoding.ids
    num_chars = len(sample.text)
    boundary, boundary_char = _token_at(encoding, sample.prefix_end, num_chars, len(ids))
    if boundary_char < sample.prefix_end:
        return PrefixUnstable(
            f"token {boundary} spans the end of the prompt (characters {boundary_char}..): "
            f"{sample.text[boundary_char:sample.prefix_end + 10]!r} encodes across the boundary"
        )
    tail_token, _ = _token_at(encoding, sample.tail_start, num_chars, len(ids))
    expected = tails(sample.text[sample.tail_start:sample.prefix_end])
    if ids[tail_token:boundary] != expected:
        return PrefixUnstable(
            f"the prompt's last tokens differ inside the conversation: {ids[tail_token:boundary]} vs "
            f"{expected} alone for {sample.text[sample.tail_start:sample.prefix_end]!r}"
        )
    loss_start = boundary if sample.loss_start == sample.prefix_end else \
        _token_at(encoding, sample.loss_start, num_chars, len(ids))[0]
    loss_end = _token_at(encoding, sample.loss_end, num_chars, len(ids))[0]
    return EncodedSample(np.array(ids, dtype=np.uint32), loss_start, max(loss_start, loss_end))


def _token_at(encoding, char: int, num_chars: int, num_tokens: int) -> tuple[int, int]:
    """(index, start char) of the first token covering `char` or a later character; (num_tokens, num_chars) if none."""
    while char < num_chars:
        token = encoding.char_to_token(char)
        if token is not None:
            return token, encoding.token_to_chars(token)[0]
        char += 1
    return num_tokens, num_chars
