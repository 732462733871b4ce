"""The target's tokenizer as tokenization needs it: the fast (Rust) tokenizer, the chat template
and the special tokens the template reads, with a content hash that changes when any of them does.

It pickles as its spec (tokenizer JSON + template + special tokens), so worker processes rebuild it
without importing the transformers model code.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tokenizers import Tokenizer

# Transformers 5.24 (pinned) compiles chat templates with this: the same sandbox, filters and
# `{% generation %}` support as `apply_chat_template`, cached per template string.
from transformers.utils.chat_template_utils import _compile_jinja_template


class TargetTokenizer:
    def __init__(self, *, tokenizer_json: str, chat_template: str, special_tokens: dict[str, str],
                 name: str = "target"):
        if not chat_template:
            raise ValueError(f"tokenizer {name!r} has no chat template: pass chat_template explicitly")
        self.name = name
        self.tokenizer_json = tokenizer_json
        self.chat_template = chat_template
        self.special_tokens = dict(sorted(special_tokens.items()))
        self.tokenizer = Tokenizer.from_str(tokenizer_json)
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self.template = _compile_jinja_template(chat_template)
        added = {token.content for token in self.tokenizer.get_added_tokens_decoder().values()}
        # Control tokens the template writes itself; any added token is a hard split, so these suffice
        # to find a split point near the end of a rendered prompt (all of them if the template has none).
        self.added_tokens = sorted([t for t in added if t in chat_template] or added, key=len, reverse=True)
        self.content_hash = hashlib.sha256(
            json.dumps([tokenizer_json, chat_template, self.special_tokens]).encode()
        ).hexdigest()

    @classmethod
    def from_hf(cls, hf_tokenizer, *, chat_template: str | None = None, name: str | None = None) -> TargetTokenizer:
        """From a transformers fast tokenizer; `chat_template` replaces the tokenizer's own."""
        if not getattr(hf_tokenizer, "is_fast", False):
            raise ValueError(f"{type(hf_tokenizer).__name__} is not a fast tokenizer; tokenization needs one")
        special = {key: str(value) for key, value in hf_tokenizer.special_tokens_map.items()
                   if isinstance(value, str)}
        return cls(
            tokenizer_json=hf_tokenizer.backend_tokenizer.to_str(),
            chat_template=chat_template or hf_tokenizer.chat_template or "",
            special_tokens=special,
            name=name or getattr(hf_tokenizer, "name_or_path", "") or "target",
        )

    @classmethod
    def from_dir(cls, path: Path, *, chat_template: str | None = None) -> TargetTokenizer:
        """From a saved tokenizer/model dir (tokenizer.json + tokenizer_config.json)."""
        from transformers import AutoTokenizer

        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"{path} has no tokenizer.json: pass a dir written by save_pretrained")
        return cls.from_hf(AutoTokenizer.from_pretrained(path), chat_template=chat_template, name=path.name)

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    def render(self, messages: list[dict], *, tools: list[dict] | None = None,
               add_generation_prompt: bool = False, **template_kwargs) -> str:
        """The chat template applied as `apply_chat_template(tokenize=False)` would apply it."""
        # Caller kwargs win over special tokens, as in apply_chat_template.
        return self.template.render(
            messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens, **template_kwargs},
        )

    def template_reads(self, field: str) -> bool:
        """Whether the template mentions `field` at all (e.g. reasoning_content, tool_calls)."""
        return field in self.chat_template

    def __getstate__(self) -> dict:
        return {"tokenizer_json": self.tokenizer_json, "chat_template": self.chat_template,
                "special_tokens": self.special_tokens, "name": self.name}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    def __repr__(self) -> str:
        return f"TargetTokenizer(name={self.name!r}, hash={self.content_hash[:12]})"
