"""Render a completion record with the target's chat template and find the loss span in characters.

The prompt keeps only its system and user turns (generation strips assistant turns the same way),
except in a regenerated conversation, whose assistant turns are the target's own earlier answers.
The prompt is rendered with the generation prompt, the full conversation without it; the full text
must start with the prompt text (prefix stability), and the characters after it are what the
target generated: thinking, answer, tool calls, and the end-of-turn token when the model emitted
it (`finish_reason != "length"`). Template text after that (e.g. a trailing newline) is not.

Templates that ignore `reasoning_content` or `tool_calls` get them inlined into the content
(`<think>...</think>` before it, Hermes `<tool_call>` blocks after it), so no generated text is lost.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from dflash_core.data.completion import CompletionRecord
from dflash_core.tokenize.config import TokenizeConfig
from dflash_core.tokenize.target import TargetTokenizer

PROMPT_ROLES = ("system", "user")
_TAIL_WINDOW = 512  # chars searched for the prefix's last control token before scanning all of it


class PrefixUnstable(ValueError):
    """The prompt's rendering (or tokens) is not a prefix of the full conversation's."""


@dataclass(frozen=True, slots=True)
class RenderedSample:
    text: str
    prefix_end: int  # first character the target generated
    loss_start: int  # first character under the loss mask (after </think> when thinking is excluded)
    loss_end: int  # one past the last character under the loss mask
    tail_start: int  # first character after the prompt's last added (control) token


def prompt_messages(record: CompletionRecord) -> list[dict]:
    """The prompt as the target saw it: system and user turns (and, in a regenerated conversation, the
    target's own earlier answers), None fields dropped."""
    if record.regenerated:
        return [m.model_dump(exclude_none=True) for m in record.prompt]
    return [{"role": m.role, "content": m.content} for m in record.prompt if m.role in PROMPT_ROLES]


def assistant_message(record: CompletionRecord, *, target: TargetTokenizer, config: TokenizeConfig) -> dict:
    """The generated turn as a message for the template, with fallbacks for templates that lack fields."""
    content = record.content
    message: dict = {"role": "assistant"}
    if record.reasoning is not None:
        if target.template_reads("reasoning_content") or target.template_reads("thinking"):
            # Same aliases apply_chat_template fills in.
            message["reasoning_content"] = record.reasoning
            message["thinking"] = record.reasoning
        elif record.reasoning.strip():
            content = f"{config.think_start}\n{record.reasoning}\n{config.think_end}\n\n{content}"
    if record.tool_calls:
        calls = [call.model_dump(exclude_none=True) for call in record.tool_calls]
        if target.template_reads("tool_calls"):
            message["tool_calls"] = calls
        else:
            blocks = [_hermes_block(call["function"]) for call in calls]
            content = "\n".join([content, *blocks]) if content else "\n".join(blocks)
    message["content"] = content
    return message


def template_kwargs(record: CompletionRecord, config: TokenizeConfig) -> dict:
    kwargs = dict(config.template_kwargs)
    if record.generation.enable_thinking is not None:
        kwargs.setdefault("enable_thinking", record.generation.enable_thinking)
    return kwargs


def render_sample(record: CompletionRecord, *, target: TargetTokenizer, config: TokenizeConfig) -> RenderedSample:
    """Render prompt and full conversation; raise `PrefixUnstable` when the first is not a prefix of the second."""
    prompt = prompt_messages(record)
    kwargs = template_kwargs(record, config)
    tools = record.tools or None
    prefix = target.render(prompt, tools=tools, add_generation_prompt=True, **kwargs)
    full = target.render([*prompt, assistant_message(record, target=target, config=config)],
                         tools=tools, add_generation_prompt=False, **kwargs)
    if not full.startswith(prefix):
        at = next((i for i, (a, b) in enumerate(zip(prefix, full)) if a != b), min(len(prefix), len(full)))
        raise PrefixUnstable(
            f"the chat template of {target.name} is not prefix-stable: the prompt rendered with the generation "
            f"prompt ends ...{prefix[max(0, at - 40):at + 20]!r}, but the full conversation has "
            f"...{full[max(0, at - 40):at + 20]!r} there (character {at}); the loss mask cannot be placed. "
            "Use a template whose generation prompt is a prefix of the rendered assistant turn "
            "(TokenizeConfig.template_kwargs may select it, e.g. enable_thinking)"
        )
    prefix_end = len(prefix)
    loss_end = _loss_end(full, prefix_end, record=record, target=target, config=config)
    loss_start = prefix_end
    if not config.include_thinking_in_loss and full[prefix_end:loss_end].lstrip().startswith(config.think_start):
        close = full.find(config.think_end, prefix_end, loss_end)
        if close >= 0:
            loss_start = close + len(config.think_end)
    return RenderedSample(full, prefix_end, loss_start, loss_end, _tail_start(prefix, target.added_tokens))


def _loss_end(full: str, prefix_end: int, *, record: CompletionRecord, target: TargetTokenizer,
              config: TokenizeConfig) -> int:
    end_of_turn = config.end_of_turn or target.eos_token
    at = full.rfind(end_of_turn, prefix_end) if end_of_turn else -1
    if at < 0:
        return len(full)
    # A completion cut at max_tokens never emitted the end-of-turn token the template adds.
    return at if record.finish_reason == "length" else at + len(end_of_turn)


def _tail_start(prefix: str, added_tokens: list[str]) -> int:
    window_start = max(0, len(prefix) - _TAIL_WINDOW)
    for start in (window_start, 0) if window_start else (0,):
        best = -1
        for token in added_tokens:
            at = prefix.rfind(token, start)
            if at >= 0:
                best = max(best, at + len(token))
        if best >= 0:
            return best
    return 0


def _hermes_block(function: dict) -> str:
    arguments = function.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return f'<tool_call>\n{{"name": {json.dumps(function["name"], ensure_ascii=False)}, "arguments": {arguments}}}\n</tool_call>'
