"""Tiny random models of real architecture families, built in code (nothing is downloaded)."""

from __future__ import annotations

import tempfile
from pathlib import Path

MODEL_CACHE = Path(tempfile.gettempdir()) / "dflash-test-models"


def build_tiny_chat_model(out_dir: Path, *, num_layers: int = 2) -> Path:
    """A 2-layer Llama with the embedded SmolLM2 tokenizer (ChatML template) that a real server can
    load. A large init range (0.3) makes a random model emit varied, non-empty text; head_dim 64
    keeps it runnable by vLLM's CPU build too."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflash_core.embedded import load_embedded_tokenizer

    tokenizer = load_embedded_tokenizer(MODEL_CACHE)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=num_layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=2048,
        initializer_range=0.3, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir.resolve()
