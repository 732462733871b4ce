"""Loss-mask boundaries against the real tokenizers: SmolLM2 (ChatML from the GGUF) and a Qwen3-style
template with thinking and tool calls. Token ids must equal `apply_chat_template(tokenize=True)`
and the masked tokens must decode to exactly what the target generated.

Run: .venv/bin/python -m pytest -q tests/unit/test_tokenize_render.py
"""

from __future__ import annotations

import pytest

from dflash_core.tokenize.config import TokenizeConfig
from dflash_core.tokenize.render import PrefixUnstable, prompt_messages, template_kwargs
from dflash_core.tokenize.shard import ShardTokenizer, tokenize_shard
from dflash_core.tokenize.target import TargetTokenizer
from tests.unit.conftest_tokenize import jsonl, make_record

WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                                 "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def tokenize_one(target, record, config=TokenizeConfig()) -> dict:
    result = ShardTokenizer(target=target, config=config).tokenize_lines([record.to_json_line()])
    assert not result.quarantine, result.quarantine
    return result.batch.to_pylist()[0]


def reference_ids(hf, record, *, assistant: dict | None, config=TokenizeConfig()) -> list[int]:
    """transformers' own apply_chat_template(tokenize=True) on the same conversation."""
    messages = prompt_messages(record) + ([assistant] if assistant else [])
    return hf.apply_chat_template(messages, tools=record.tools, tokenize=True, return_dict=False,
                                  add_generation_prompt=assistant is None, **template_kwargs(record, config))


def masked_text(hf, row) -> str:
    ids = [i for i, m in zip(row["input_ids"], row["loss_mask"]) if m]
    return hf.decode(ids)


def assert_mask(hf, record, row, *, assistant: dict, loss_text: str, config=TokenizeConfig()) -> None:
    full = reference_ids(hf, record, assistant=assistant, config=config)
    prefix = reference_ids(hf, record, assistant=None, config=config)
    assert row["input_ids"] == full
    mask = row["loss_mask"]
    first = mask.index(1)
    span = first + sum(mask)
    assert mask[first:span] == [1] * sum(mask), "loss mask must be one contiguous span"
    assert masked_text(hf, row) == loss_text
    if config.include_thinking_in_loss:
        assert first == len(prefix), "loss must start right after the prompt's tokens"
    assert row["num_loss_tokens"] == sum(mask) and row["num_tokens"] == len(full)


def test_smollm2_single_turn(smol_hf, smol_target):
    record = make_record(reasoning=None, generation={"model": "m"})
    row = tokenize_one(smol_target, record)
    assert_mask(smol_hf, record, row, assistant={"role": "assistant", "content": "It is 4."},
                loss_text="It is 4.<|im_end|>")


def test_smollm2_multi_turn_keeps_only_user_and_system_turns(smol_hf, smol_target):
    prompt = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! (from the source dataset, never rendered)"},
        {"role": "user", "content": "What is 2 + 2?"},
    ]
    record = make_record(prompt=prompt, reasoning=None, generation={"model": "m"})
    row = tokenize_one(smol_target, record)
    assert_mask(smol_hf, record, row, assistant={"role": "assistant", "content": "It is 4."},
                loss_text="It is 4.<|im_end|>")
    assert "never rendered" not in smol_hf.decode(row["input_ids"])
    assert smol_hf.decode(row["input_ids"]).count("<|im_start|>user") == 2


def test_regenerated_conversation_renders_the_targets_own_answers_as_context(smol_hf, smol_target):
    """regenerate_turns: earlier answers are the target's own, so they are rendered; the loss is the last one."""
    prompt = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! (the target's own first answer)"},
        {"role": "user", "content": "What is 2 + 2?"},
    ]
    record = make_record(prompt=prompt, reasoning=None, generation={"model": "m"}, regenerated=True)
    row = tokenize_one(smol_target, record)
    assert_mask(smol_hf, record, row, assistant={"role": "assistant", "content": "It is 4."},
                loss_text="It is 4.<|im_end|>")
    text = smol_hf.decode(row["input_ids"])
    assert "the target's own first answer" in text and text.count("<|im_start|>assistant") == 2


def test_smollm2_inlines_reasoning_and_tool_calls_it_cannot_render(smol_hf, smol_target):
    record = make_record(tool_calls=[{"function": {"name": "calc", "arguments": '{"x": 2}'}}])
    row = tokenize_one(smol_target, record)
    generated = ("<think>\nTwo plus two is four.\n</think>\n\nIt is 4.\n"
                 '<tool_call>\n{"name": "calc", "arguments": {"x": 2}}\n</tool_call>')
    assert_mask(smol_hf, record, row, assistant={"role": "assistant", "content": generated},
                loss_text=generated + "<|im_end|>")


def test_qwen_style_thinking_on(qwen_hf, qwen_target):
    record = make_record()
    row = tokenize_one(qwen_target, record)
    assistant = {"role": "assistant", "content": "It is 4.", "reasoning_content": "Two plus two is four."}
    assert_mask(qwen_hf, record, row, assistant=assistant,
                loss_text="<think>\nTwo plus two is four.\n</think>\n\nIt is 4.<|im_end|>")


def test_qwen_style_thinking_excluded_from_loss(qwen_hf, qwen_target):
    record = make_record()
    config = TokenizeConfig(include_thinking_in_loss=False)
    row = tokenize_one(qwen_target, record, config)
    assistant = {"role": "assistant", "content": "It is 4.", "reasoning_content": "Two plus two is four."}
    assert_mask(qwen_hf, record, row, assistant=assistant, loss_text="\n\nIt is 4.<|im_end|>", config=config)


def test_qwen_style_thinking_off_prefills_empty_think_block(qwen_hf, qwen_target):
    record = make_record(reasoning=None, generation={"model": "m", "enable_thinking": False})
    row = tokenize_one(qwen_target, record)
    assistant = {"role": "assistant", "content": "It is 4."}
    assert_mask(qwen_hf, record, row, assistant=assistant, loss_text="It is 4.<|im_end|>")
    assert qwen_hf.decode(row["input_ids"]).endswith("<think>\n\n</think>\n\nIt is 4.<|im_end|>\n")
    assert not row["empty_reasoning"], "thinking was off: empty reasoning is expected"


def test_qwen_style_tool_calls_with_tools_in_the_system_prompt(qwen_hf, qwen_target):
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    record = make_record(tools=[WEATHER_TOOL], content="Let me check.", tool_calls=[call],
                         finish_reason="tool_calls",
                         prompt=[{"role": "system", "content": "You help."},
                                 {"role": "user", "content": "Weather in Paris?"}])
    row = tokenize_one(qwen_target, record)
    assistant = {"role": "assistant", "content": "Let me check.", "reasoning_content": "Two plus two is four.",
                 "tool_calls": [call]}
    assert_mask(qwen_hf, record, row, assistant=assistant, loss_text=(
        "<think>\nTwo plus two is four.\n</think>\n\nLet me check.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'))
    assert "# Tools" in qwen_hf.decode(row["input_ids"])


def test_length_finish_leaves_the_end_of_turn_token_out_of_the_loss(qwen_hf, qwen_target):
    record = make_record(content="It is", finish_reason="length")
    row = tokenize_one(qwen_target, record)
    assert masked_text(qwen_hf, row) == "<think>\nTwo plus two is four.\n</think>\n\nIt is"
    assert qwen_hf.decode(row["input_ids"]).endswith("It is<|im_end|>\n")


def test_template_that_is_not_prefix_stable_fails_clearly(smol_hf):
    template = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
                "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>model\\n' }}{%- endif %}")
    target = TargetTokenizer.from_hf(smol_hf, chat_template=template, name="bad-template")
    with pytest.raises(PrefixUnstable, match="bad-template is not prefix-stable") as error:
        ShardTokenizer(target=target, config=TokenizeConfig())
    assert isinstance(error.value, ValueError)


def test_content_that_merges_across_the_prompt_boundary_is_quarantined(smol_hf):
    # Generation prompt ends in punctuation; an answer starting with punctuation fuses with it.
    template = ("{%- for m in messages %}{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant:' + m.content"
                " + '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
                "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant:' }}{%- endif %}")
    target = TargetTokenizer.from_hf(smol_hf, chat_template=template, name="colon")
    good = make_record(id="good", reasoning=None, content="Four")
    fused = make_record(id="fused", reasoning=None, content=":) four")
    result = tokenize_shard(jsonl(good, fused), target=target, config=TokenizeConfig())
    assert result.table.column("id").to_pylist() == ["good"]
    assert result.skipped == {"prefix_unstable": 1}
    assert result.quarantine[0].line == 2 and result.quarantine[0].source == "unit"


def test_thinking_off_prompt_that_retokenizes_differently_fails_the_shard(smol_hf):
    # GPT-2's split encodes the prompt's trailing "\n\n" as one token alone but as two before text.
    from tests.unit.conftest_tokenize import QWEN_STYLE_TEMPLATE

    target = TargetTokenizer.from_hf(smol_hf, chat_template=QWEN_STYLE_TEMPLATE, name="gpt2-split")
    worker = ShardTokenizer(target=target, config=TokenizeConfig())  # thinking on: stable
    record = make_record(reasoning=None, generation={"model": "m", "enable_thinking": False})
    with pytest.raises(PrefixUnstable, match=r"gpt2-split is not prefix-stable in tokens \(enable_thinking=False\)"):
        worker.tokenize_lines([record.to_json_line()])
