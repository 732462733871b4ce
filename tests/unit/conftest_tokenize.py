"""What the tokenization tests share: record builders, and what the tokenizers that tests/unit/conftest.py
serves once per session are. `smol_hf` is the embedded SmolLM2 tokenizer from the GGUF (ChatML, no
thinking, no tools), cached across runs in the system temp dir (first conversion ~5 s, then ~0.2 s).
`qwen_hf` is the same vocabulary with Qwen3-style added tokens and a Qwen3-like chat template built
here: thinking block in the last assistant turn, `enable_thinking=False` pre-filling an empty one,
tools in the system prompt and `<tool_call>` blocks after the content.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from dflash_core.data.completion import CompletionRecord

# Persistent across runs; the embedded cache writes atomically, so concurrent sessions are safe.
MODEL_CACHE = Path(tempfile.gettempdir()) / "dflash-test-models"

QWEN_STYLE_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags.<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}"
    "{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set reasoning = message.reasoning_content if message.reasoning_content is defined and "
    "message.reasoning_content is not none else '' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.last %}{{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- (message.content or '').lstrip('\\n') }}"
    "{%- if message.tool_calls %}{%- for tc in message.tool_calls %}"
    "{%- if (loop.first and message.content) or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{%- set f = tc.function if tc.function is defined else tc %}"
    "{{- '<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' }}"
    "{%- if f.arguments is string %}{{- f.arguments }}{%- else %}{{- f.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
QWEN_ADDED_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
# Qwen2/3's pre-tokenizer split: newline runs stay one piece ("\n\nIt" -> "\n\n", "It"), which is
# what makes Qwen's `</think>\n\n` generation prompt prefix-stable. GPT-2's split (SmolLM2) is not.
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def make_record(**fields) -> CompletionRecord:
    """A valid record; keyword fields override the defaults."""
    base = {
        "id": "r0",
        "source": "unit",
        "prompt": [{"role": "user", "content": "What is 2 + 2?"}],
        "reasoning": "Two plus two is four.",
        "content": "It is 4.",
        "finish_reason": "stop",
        "generation": {"model": "unit", "enable_thinking": True},
    }
    return CompletionRecord.model_validate({**base, **fields})


def jsonl(*records: CompletionRecord | dict | bytes) -> bytes:
    out = []
    for record in records:
        if isinstance(record, CompletionRecord):
            out.append(record.to_json_line())
        elif isinstance(record, dict):
            out.append(CompletionRecord.model_validate(record).to_json_line())
        else:
            out.append(record.rstrip(b"\n") + b"\n")
    return b"".join(out)
