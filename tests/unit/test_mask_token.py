"""The mask token: never an end token, never a row the data uses; SmolLM2 gets an unused special.

Run: .venv/bin/python -m pytest tests/unit/test_mask_token.py -q
"""

import pytest
import transformers

from dflash_core.model import DFlashConfig
from dflash_core.model.mask_token import choose_mask_token_id, end_token_ids, resolve_mask_token_id
from tests.tiny_models import MODEL_CACHE


@pytest.fixture(scope="module")
def smol_tokenizer():
    pytest.importorskip("gguf", reason="the embedded tokenizer is converted from its GGUF")
    from dflash_core.embedded import load_embedded_tokenizer

    return load_embedded_tokenizer(MODEL_CACHE)


def _smol_config(vocab_size: int = 49152):
    """SmolLM2-135M's token settings: pad = EOS = <|im_end|> (2), BOS <|im_start|> (1)."""
    return transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                    num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2,
                                    pad_token_id=2)


def test_smollm2_gets_a_special_token_its_chat_template_never_uses(smol_tokenizer):
    config = _smol_config()
    mask = choose_mask_token_id(config, tokenizer=smol_tokenizer)
    assert smol_tokenizer.convert_ids_to_tokens(mask) == "<empty_output>"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    chat = smol_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    chat = chat["input_ids"] if hasattr(chat, "keys") else chat
    assert mask not in chat and mask not in end_token_ids(config, tokenizer=smol_tokenizer)
    # A corpus that does contain it moves the choice to the next unused special.
    counts = [0] * 49152
    counts[mask] = 3
    second = choose_mask_token_id(config, tokenizer=smol_tokenizer, token_counts=counts)
    assert second != mask and second in smol_tokenizer.added_tokens_decoder


def test_spare_embedding_rows_win(smol_tokenizer):
    """As the reference does for Qwen3 (151,669 of 151,936 rows): the first row past the tokenizer."""
    assert choose_mask_token_id(_smol_config(vocab_size=49152 + 64), tokenizer=smol_tokenizer) == 49152


def test_end_tokens_are_refused_by_name(smol_tokenizer):
    config = _smol_config()
    for token_id, name in ((2, "<|im_end|>"), (0, "<|endoftext|>")):
        with pytest.raises(ValueError, match=rf"end token '{name}'".replace("|", r"\|")):
            resolve_mask_token_id(token_id, target_config=config, tokenizer=smol_tokenizer)
    with pytest.raises(ValueError, match="end token"):  # the config alone knows its EOS
        resolve_mask_token_id(2, target_config=config)
    with pytest.raises(ValueError, match="not a row"):
        resolve_mask_token_id(49152, target_config=config)
    assert resolve_mask_token_id(5, target_config=config, tokenizer=smol_tokenizer) == 5


def test_without_a_tokenizer_never_pad_or_eos():
    config = _smol_config()
    assert choose_mask_token_id(config) == 49151
    assert DFlashConfig.from_target(config, num_layers=1, block_size=8).mask_token_id == 49151
    counts = [0] * 49152
    counts[49151] = counts[49150] = 1
    assert choose_mask_token_id(config, token_counts=counts) == 49149
    qwen = transformers.Qwen3Config(vocab_size=300, eos_token_id=299, pad_token_id=298, num_hidden_layers=6)
    assert choose_mask_token_id(qwen) == 297
