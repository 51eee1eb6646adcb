"""A compact Llama-family decoder with an explicit, preallocated KV cache.

One implementation serves the Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm) families. Module
and parameter names mirror Hugging Face's, so a checkpoint's state dict loads with ``strict=True``.

The cache is owned by the caller (an engine), not the model: ``forward`` writes the new tokens' keys and
values at per-row positions and attends over the valid prefix. Rolling the cache back after a rejected
draft is therefore just moving a length pointer; stale entries beyond it are masked and later overwritten.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}  # weights and KV, by name
# config.json key of a vocabulary-pruned draft (as specdec-distill writes): the sorted token ids its output
# head scores. Every other token gets logit -inf, so the draft's q is exactly 0 there and rejection sampling
# stays exact (the target's residual max(0, p - q) covers those tokens).
DRAFT_VOCAB_KEY = "specdec_draft_vocab"
_ROPE_CLASS_PREFIX = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
_UNSUPPORTED_ROPE = ("dynamic", "longrope")


class UnsupportedModelError(ValueError):
    """The checkpoint describes an architecture the compact decoder does not implement."""


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of one decoder, read from a Hugging Face config."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    hf_config: Any = field(compare=False, repr=False)
    draft_vocab: tuple[int, ...] | None = field(default=None, repr=False)

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        """Validate a transformers ``PretrainedConfig`` and extract what the decoder needs."""
        family = hf_config.model_type
        if family not in SUPPORTED_FAMILIES:
            raise UnsupportedModelError(
                f"model_type {family!r} is not supported; supported families: {', '.join(SUPPORTED_FAMILIES)}"
            )
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {hf_config.hidden_act!r} is not supported (only 'silu')")
        rope_type = (getattr(hf_config, "rope_parameters", None) or {}).get("rope_type", "default")
        if rope_type in _UNSUPPORTED_ROPE:
            raise UnsupportedModelError(
                f"rope_type {rope_type!r} changes with the sequence length and is not supported"
            )
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        qkv_bias = {"qwen2": True, "mistral": False}.get(family, attention_bias)
        o_bias = False if family in ("qwen2", "mistral") else attention_bias
        eos = hf_config.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        return cls(
            family=family,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=hf_config.num_attention_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
            head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads,
            rms_norm_eps=hf_config.rms_norm_eps,
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            qk_norm=family == "qwen3",
            sliding_window=_sliding_window(hf_config),
            eos_token_ids=eos_ids,
            hf_config=hf_config,
            draft_vocab=_draft_vocab(hf_config),
        )

    @property
    def max_context(self) -> int:
        """Longest context this implementation attends over exactly (sliding windows are not implemented,
        so attention is only exact while the context fits inside the window)."""
        limit = self.max_position_embeddings
        return min(limit, self.sliding_window) if self.sliding_window else limit


def _draft_vocab(hf_config: Any) -> tuple[int, ...] | None:
    ids = getattr(hf_config, DRAFT_VOCAB_KEY, None)
    if ids is None:
        return None
    vocab = hf_config.vocab_size
    if (
        not isinstance(ids, (list, tuple))
        or not ids
        or not all(isinstance(i, int) and 0 <= i < vocab for i in ids)
        or list(ids) != sorted(set(ids))
    ):
        raise UnsupportedModelError(
            f"{DRAFT_VOCAB_KEY} must be a non-empty, sorted list of distinct token ids in [0, {vocab})"
        )
    return tuple(ids)


def _sliding_window(hf_config: Any) -> int | None:
    window = getattr(hf_config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(hf_config, "layer_types", None)
    if hf_config.model_type in ("qwen2", "qwen3"):
        uses_window = getattr(hf_config, "use_sliding_window", False) or (
            layer_types is not None and "sliding_attention" in layer_types
        )
        return int(window) if uses_window else None
    return int(window)


def rope_tables(config: ModelConfig, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables ``[max_positions, head_dim]`` computed by transformers' own rotary embedding
    for the family, so every rope scaling type it knows (linear, yarn, llama3, ...) is handled by it."""
    module = importlib.import_module(f"transformers.models.{config.family}.modeling_{config.family}")
    rotary = getattr(module, f"{_ROPE_CLASS_PREFIX[config.family]}RotaryEmbedding")(config.hf_config)
    positions = torch.arange(max_positions)[None]
    cos, sin = rotary(torch.zeros((), dtype=torch.float32), positions)
    return cos[0], sin[0]


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in float32 like transformers does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """Grouped-query attention that writes its keys/values into a caller-owned cache."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        q_dim, kv_dim = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_dim, config.hidden_size, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm

    def forward(self, x: torch.Tensor, step: StepInputs, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        batch, new, _ = x.shape
        q = self.q_proj(x).view(batch, new, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(batch, new, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, new, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = step.cos, step.sin
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        # Cache layout [B, H_kv, S, D]: row b's new tokens go to its own positions.
        k_cache[step.rows, :, step.positions] = k.to(k_cache.dtype)
        v_cache[step.rows, :, step.positions] = v.to(v_cache.dtype)
        keys = k_cache[:, :, : step.attended]
        values = v_cache[:, :, : step.attended]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2).to(keys.dtype), keys, values, attn_mask=step.mask, enable_gqa=True
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, new, -1).to(x.dtype))


class MLP(nn.Module):
    """SwiGLU feed-forward block."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP block."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, step: StepInputs, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), step, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass(frozen=True)
class StepInputs:
    """Per-call tensors shared by every layer: where the new tokens go and what they may attend to."""

    rows: torch.Tensor  # [B, 1] row index, broadcast against positions
    positions: torch.Tensor  # [B, T] absolute position of each new token
    cos: torch.Tensor  # [B, T, 1, D]
    sin: torch.Tensor  # [B, T, 1, D]
    mask: torch.Tensor  # [B, 1, T, attended] True where a key may be attended
    attended: int  # number of cache positions any row attends over


class _Backbone(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CompactDecoder(nn.Module):
    """The decoder: ``forward(token_ids, starts, k_cache, v_cache)`` appends T tokens per row at that
    row's start position and returns float32 logits."""

    def __init__(self, config: ModelConfig, max_context: int) -> None:
        super().__init__()
        self.config = config
        self.max_context = max_context
        self.model = _Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        cos, sin = rope_tables(config, max_context)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if config.draft_vocab is not None:
            self.register_buffer("draft_vocab", torch.tensor(config.draft_vocab), persistent=False)
            self.register_buffer("logit_source", pruned_logit_source(config), persistent=False)
            # The head's draft-vocabulary rows, gathered once by load_weights rather than at every step, and
            # stored transposed [hidden, V_draft]: x @ pruned_head needs no repacking on a CPU (cpu_linear.py).
            pruned_head = torch.zeros(config.hidden_size, len(config.draft_vocab))
            self.register_buffer("pruned_head", pruned_head, persistent=False)

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load a Hugging Face state dict; ties the output head to the embeddings when the config says so."""
        weights = {k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
        if self.config.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
            self.lm_head.weight = self.model.embed_tokens.weight
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
        missing, unexpected = self.load_state_dict(weights, strict=False)
        if missing or unexpected:
            raise UnsupportedModelError(
                "checkpoint tensors do not match the architecture: "
                f"missing {sorted(missing)[:6]}, unexpected {sorted(unexpected)[:6]}"
            )
        if self.config.draft_vocab is not None:
            self.pruned_head.copy_(self.lm_head.weight.detach()[self.draft_vocab].T)

    def new_cache(
        self, batch_size: int, dtype: torch.dtype, device: torch.device | str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Preallocated key and value caches ``[layers, B, H_kv, max_context, D]``."""
        c = self.config
        shape = (c.num_layers, batch_size, c.num_kv_heads, self.max_context, c.head_dim)
        return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)

    def step_inputs(
        self, starts: torch.Tensor, num_new: int, dtype: torch.dtype, attended: int | None = None
    ) -> StepInputs:
        """Positions, rotary tables and attention mask for ``num_new`` tokens after ``starts`` [B], attending
        over the first ``attended`` cache positions (default: as many as the longest row needs, which reads
        ``starts`` on the host; a larger span masks the extra positions and gives the same logits)."""
        device = self.rope_cos.device
        starts = starts.to(device)
        positions = starts[:, None] + torch.arange(num_new, device=device)
        if attended is None:
            attended = int(starts.max()) + num_new
        mask = torch.arange(attended, device=device)[None, None, :] <= positions[:, :, None]
        return StepInputs(
            rows=torch.arange(len(starts), device=device)[:, None],
            positions=positions,
            cos=self.rope_cos[positions][:, :, None, :].to(dtype),
            sin=self.rope_sin[positions][:, :, None, :].to(dtype),
            mask=mask[:, None],
            attended=attended,
        )

    def forward(
        self,
        token_ids: torch.Tensor,
        starts: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        logits_at: torch.Tensor | None = None,
        attended: int | None = None,
    ) -> torch.Tensor:
        """Run ``token_ids`` [B, T] placed at ``starts`` [B] + 0..T-1; returns float32 logits [B, T, V], or at
        the per-row indices ``logits_at`` when given: [B, V] for one index a row [B], [B, K, V] for [B, K].
        ``attended``: a fixed attention span (see ``step_inputs``), so the shapes do not depend on ``starts``."""
        x = self.model.embed_tokens(token_ids.to(self.rope_cos.device))
        step = self.step_inputs(starts, token_ids.shape[1], x.dtype, attended)
        for layer, k_layer, v_layer in zip(self.model.layers, k_cache, v_cache):
            x = layer(x, step, k_layer, v_layer)
        if logits_at is not None:
            x = x[step.rows if logits_at.dim() == 2 else step.rows[:, 0], logits_at.to(x.device)]
        x = self.model.norm(x)
        if self.config.draft_vocab is None:
            return self.lm_head(x).float()
        pruned = (x @ self.pruned_head).float()
        return F.pad(pruned, (0, 1), value=float("-inf"))[..., self.logit_source]


def pruned_logit_source(config: ModelConfig) -> torch.Tensor:
    """For each token id, its column in a pruned draft's logits padded with one -inf column at the end
    (the column every token outside the draft vocabulary reads)."""
    source = torch.full((config.vocab_size,), len(config.draft_vocab), dtype=torch.int64)
    source[list(config.draft_vocab)] = torch.arange(len(config.draft_vocab))
    return source
