"""Inference servers (vLLM, SGLang, transformers serve) and on-policy generation against them."""
