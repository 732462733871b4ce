"""The drafter's decoder layer: target-family attention with KV injection, RoPE, SwiGLU MLP.

KV injection: queries come from the block only; keys and values are
cat(proj(target context), proj(block)), so each layer re-reads the target's features.
The attention kernel itself (flex or dense SDPA) is passed in as `attend`, so this module is
the same for training, the CPU fallback and drafting with a cache.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dflash_core.model.config import DFlashConfig

# attend(query_BNQD, key_BKSD, value_BKSD) -> out_BNQD; K heads may be fewer than N heads (GQA).
AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, weight applied in the input dtype (the Llama/Qwen3 convention)."""

    def __init__(self, dim: int, *, eps: float, device=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(x.dtype) * normed.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Default RoPE on the first `rotary_dim` channels of each head (partial rotary when smaller)."""

    def __init__(self, *, rotary_dim: int, theta: float, device=None) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        self.theta = theta
        self.register_buffer("inv_freq", self._inv_freq(device), persistent=False)

    def _inv_freq(self, device) -> torch.Tensor:
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32, device=device) / self.rotary_dim
        return 1.0 / (self.theta**exponents)

    def reset_buffers(self) -> None:
        self.inv_freq = self._inv_freq(self.inv_freq.device)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos, sin of shape [*position_ids.shape, rotary_dim] (cast to q/k's dtype on use)."""
        freqs = position_ids.float()[..., None] * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rope(x_BHSD: torch.Tensor, cos_BSR: torch.Tensor, sin_BSR: torch.Tensor) -> torch.Tensor:
    """Rotate the first R channels of every head; the rest pass through (partial rotary)."""
    rotary_dim = cos_BSR.shape[-1]
    cos, sin = cos_BSR[:, None].to(x_BHSD.dtype), sin_BSR[:, None].to(x_BHSD.dtype)
    if rotary_dim == x_BHSD.shape[-1]:
        return x_BHSD * cos + _rotate_half(x_BHSD) * sin
    rot, rest = x_BHSD[..., :rotary_dim], x_BHSD[..., rotary_dim:]
    return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)


class DFlashAttention(nn.Module):
    """GQA attention whose K/V cover [target context ; block] and whose Q covers the block."""

    def __init__(self, config: DFlashConfig, *, device=None) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias, device=device)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias, device=device)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias, device=device)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False, device=device)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps, device=device)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps, device=device)
        else:
            self.q_norm = self.k_norm = None

    def _heads(self, x_BSX: torch.Tensor, num_heads: int) -> torch.Tensor:
        batch, seq, _ = x_BSX.shape
        return x_BSX.view(batch, seq, num_heads, self.head_dim).transpose(1, 2)

    def key_value(
        self, hidden_BSH: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Projected, normed, rotated K and V: [B, kv_heads, S, head_dim] each."""
        key = self._heads(self.k_proj(hidden_BSH), self.num_kv_heads)
        if self.k_norm is not None:
            key = self.k_norm(key)
        key = apply_rope(key, *rope)
        return key, self._heads(self.v_proj(hidden_BSH), self.num_kv_heads)

    def forward(
        self,
        block_BQH: torch.Tensor,
        *,
        block_rope: tuple[torch.Tensor, torch.Tensor],
        context_kv: tuple[torch.Tensor, torch.Tensor],
        attend: AttendFn,
    ) -> torch.Tensor:
        query = self._heads(self.q_proj(block_BQH), self.num_heads)
        if self.q_norm is not None:
            query = self.q_norm(query)
        query = apply_rope(query, *block_rope)
        block_key, block_value = self.key_value(block_BQH, block_rope)
        key = torch.cat((context_kv[0], block_key), dim=2)
        value = torch.cat((context_kv[1], block_value), dim=2)
        out = attend(query, key, value)
        batch, _, seq, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, *, hidden_size: int, intermediate_size: int, device=None) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False, device=device)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False, device=device)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    """Pre-norm residual layer. The target context enters already fused and normed (no layer norm)."""

    def __init__(self, config: DFlashConfig, *, layer_type: str, device=None) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, device=device)
        self.self_attn = DFlashAttention(config, device=device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, device=device)
        self.mlp = SwiGLU(
            hidden_size=config.hidden_size, intermediate_size=config.intermediate_size, device=device
        )

    def forward(
        self,
        block_BQH: torch.Tensor,
        *,
        block_rope: tuple[torch.Tensor, torch.Tensor],
        context_kv: tuple[torch.Tensor, torch.Tensor],
        attend: AttendFn,
        branch_masks: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`branch_masks` (training dropout): scaled keep-masks [B, Q, H] for the attention and the MLP
        output, each multiplied in before its residual add."""
        attn_out = self.self_attn(
            self.input_layernorm(block_BQH), block_rope=block_rope, context_kv=context_kv, attend=attend
        )
        hidden = block_BQH + drop(attn_out, branch_masks, 0)
        return hidden + drop(self.mlp(self.post_attention_layernorm(hidden)), branch_masks, 1)


def drop(branch_BQH: torch.Tensor, masks: tuple[torch.Tensor, torch.Tensor] | None, index: int) -> torch.Tensor:
    """A sublayer's output times its dropout keep-mask (unchanged without masks)."""
    return branch_BQH if masks is None else branch_BQH * masks[index].to(branch_BQH.dtype)
