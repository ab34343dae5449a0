"""The one decoder behind Qwen3, Llama, Qwen2 and Mistral, and its output type.

Families differ only by flags read from `ModelConfig` (q/k RMSNorm, biases, RoPE variant, tied
embeddings, sliding window). Module and parameter names mirror transformers' (`model.layers.0.
self_attn.q_proj.weight`), so a Hugging Face state dict loads with no renaming and ours saves back.

Design choices, so that the generation engine, the trainer and tensor parallelism can use it as it is:
- Attention takes an optional `kv_cache` object with `update(layer_idx, k, v, cache_position) ->
  (keys, values)`: a preallocated cache is written in place by the engine's cache, never here.
- Masks are built once per forward as booleans `[batch, 1, queries, keys]` from a 2-D padding mask
  over the keys (the static cache's whole length), the queries' cache positions, per-layer sliding
  windows and, for packed training rows, document boundaries found in `position_ids` (a position that
  does not follow its left neighbour starts a new document, as transformers does). A row of queries
  that may see nothing (left padding) is opened fully so that no NaN leaks; its output is never used.
- Heads are read from the weights' shapes at run time (`-1` in views), so a tensor-parallel plan that
  shards q/k/v column-wise needs nothing from this file.
- No parallelism, no device logic, no compile calls here.
- A cache object may also choose the formulation of its forward (`kv_cache.linears`,
  `kv_cache.head_linear`, `kv_cache.decode_attention`; the plain path when absent): the generation
  engine's compiled steps can read every weight once as a multiply-and-sum reduction ("reduce"),
  run the GEMMs through oneDNN ("onednn", `kernels.py`), and attend with fused reductions ("reduce",
  one query per row) or grouped matmuls ("matmul"), query heads reshaped per KV head with no KV
  copy, which inductor turns into weight-streaming loops. Same math, same dtypes out; without such
  a cache `model(...)` is unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .kernels import onednn_linear


# ---------------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------------
@dataclass
class CausalLMOutput:
    """`.logits` `[batch, seq, vocab]` (or the kept positions) and `.loss` when labels were given."""

    logits: torch.Tensor
    loss: Optional[torch.Tensor] = None

    def __getitem__(self, key: Union[str, int]) -> Any:
        if isinstance(key, int):
            return self.to_tuple()[key]
        return getattr(self, key)

    def keys(self):
        return [k for k in ("loss", "logits") if getattr(self, k) is not None]

    def to_tuple(self) -> tuple:
        return tuple(getattr(self, k) for k in self.keys())


# ---------------------------------------------------------------------------------------------
# building blocks
# ---------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back, as transformers does (bf16 parity)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_inv_freq(config: ModelConfig, device: Optional[torch.device] = None) -> torch.Tensor:
    """Inverse frequencies for the config's RoPE variant (default, linear, llama3, yarn)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif kind == "yarn":
        inv_freq = _yarn_inv_freq(config, inv_freq, device)
    return inv_freq


def _yarn_inv_freq(config: ModelConfig, extrapolation: torch.Tensor, device) -> torch.Tensor:
    """YaRN: interpolate the low frequencies by `factor`, keep the high ones, ramp between (the paper's
    correction range from beta_fast/beta_slow rotations over the original context)."""
    scaling, dim, base = config.rope_scaling, config.head_dim, config.rope_theta
    factor = float(scaling["factor"])
    original = float(scaling.get("original_max_position_embeddings") or config.max_position_embeddings)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (high frequency), 0: interpolate
    return (extrapolation / factor) * (1 - keep) + extrapolation * keep


def rope_attention_factor(config: ModelConfig) -> float:
    """The factor YaRN applies to cos/sin (1.0 for every other variant)."""
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = float(scaling["factor"])
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
    return mscale(factor)


class RotaryEmbedding(nn.Module):
    """cos/sin for given positions; `inv_freq` is a non-persistent buffer rebuilt after meta init."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        # computed on the CPU even under a meta-device context: pow on meta pages in ~70 MB of kernels
        self.register_buffer("inv_freq", rope_inv_freq(config, device=torch.device("cpu")), persistent=False)
        self.attention_factor = rope_attention_factor(config)

    def reset_parameters(self, device: Optional[torch.device] = None) -> None:
        """Recompute the frequencies (on `device`, else where they are): a meta-built model's last step."""
        self.inv_freq = rope_inv_freq(self.config, device=device if device is not None else self.inv_freq.device)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, heads, seq, head_dim]; cos/sin: [batch, seq, head_dim]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def project(layer: nn.Linear, x: torch.Tensor, how: Optional[str] = None) -> torch.Tensor:
    """`layer(x)` (`how=None`), the same product through oneDNN's GEMM (`"onednn"`, inference only), or
    as a float32 multiply-and-sum over the weight rows (`"reduce"`).

    The reduction puts the weight's rows outermost (`[out, tokens]`, then transposed back), so the
    loop inductor generates reads each weight row once for all the tokens of a small decode batch."""
    if how is None:
        return layer(x)
    if how == "onednn":
        return onednn_linear(layer, x)
    lead, k = x.shape[:-1], x.shape[-1]
    y = (layer.weight.float().unsqueeze(1) * x.reshape(1, -1, k).float()).sum(-1).t()
    if layer.bias is not None:
        y = y + layer.bias.float()
    return y.reshape(*lead, -1).to(x.dtype)


def attend_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """One query per row: attention as multiply-and-sum reductions (float32) with the query heads
    grouped per KV head, which inductor fuses into loops reading each cached key and value once
    (no matmul calls, no KV copy). q `[b, h, 1, d]`, k/v `[b, kvh, L, d]`, mask `[b, 1, 1, L]`."""
    b, h, s, d = q.shape
    kvh = k.shape[1]
    qg = q.reshape(b, kvh, h // kvh, 1, d).float()
    scores = (qg * k.unsqueeze(2).float()).sum(-1) * scale  # [b, kvh, g, L]
    if mask is not None:
        scores = scores.masked_fill(~mask.reshape(mask.shape[0], 1, 1, -1), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = (probs.unsqueeze(-1) * v.unsqueeze(2).float()).sum(-2)  # [b, kvh, g, d]
    return out.reshape(b, h, s, d).to(v.dtype)


def attend_grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """Attention as matmul + softmax (float32) + matmul with the query heads grouped per KV head."""
    b, h, s, d = q.shape
    kvh, kv_len = k.shape[1], k.shape[2]
    g = h // kvh
    qg = q.reshape(b, kvh, g * s, d)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale
    if mask is None:
        mask = causal_rows(s, kv_len, q.device)
    mask = mask.unsqueeze(2).expand(mask.shape[0], 1, g, s, kv_len).reshape(mask.shape[0], 1, g * s, kv_len)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).reshape(b, h, s, d)


CPU_BLOCK = 128  # query block of `attend_blocks`


def attend_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], scale: float,
                  block: int = CPU_BLOCK) -> torch.Tensor:
    """Causal self-attention (queries = keys) in query blocks: block i attends to the keys up to its
    end only, each as matmul + float32 softmax + matmul (KV heads repeated per query head). It skips
    most of the masked upper triangle; on a CPU in bf16 it runs about 2.4x faster (forward and
    backward, 256 positions) than the CPU SDPA kernel. `mask` (packed documents, padding, windows)
    already contains causality; without one it is built from positions."""
    b, h, s, d = q.shape
    g = h // k.shape[1]
    if g > 1:
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    outs = []
    for start in range(0, s, block):
        end = min(start + block, s)
        scores = torch.matmul(q[:, :, start:end], k[:, :, :end].transpose(-1, -2)).float() * scale
        if mask is None:
            rows = torch.arange(start, end, device=q.device)[:, None]
            hidden = torch.arange(end, device=q.device)[None, :] > rows
        else:
            hidden = ~mask[:, :, start:end, :end]
        scores = scores.masked_fill(hidden, float("-inf"))
        outs.append(torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v[:, :, :end]))
    return torch.cat(outs, 2)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """Scaled dot-product attention with grouped KV heads; mask is boolean (True = may attend).

    Causal self-attention of bf16/fp16 on a CPU over at least two query blocks runs `attend_blocks`."""
    s = q.shape[2]
    if (q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16) and s == k.shape[2]
            and s >= 2 * CPU_BLOCK):
        return attend_blocks(q, k, v, mask, scale)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def last_rows(mask: Optional[torch.Tensor], keep: int, kv_len: int, device: torch.device) -> Optional[torch.Tensor]:
    """The rows of a self-attention mask `[b, 1, q, kv]` for the last `keep` queries. None (plain causal
    attention) stays None for the last query alone, which sees every key; for more, their causal rows
    are built (SDPA's `is_causal` aligns a shorter query block to the first keys, not the last)."""
    if mask is not None:
        return mask[:, :, -keep:]
    if keep == 1:
        return None
    return causal_rows(keep, kv_len, device)


def causal_rows(q_len: int, kv_len: int, device) -> torch.Tensor:
    """The causal mask `[1, 1, q_len, kv_len]` of the last `q_len` positions over all `kv_len` keys."""
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(kv_len - q_len)[None, None]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        h, hd = config.hidden_size, config.head_dim
        self.layer_idx = layer_idx
        self.head_dim = hd
        self.scale = hd ** -0.5
        self.window = config.layer_window(layer_idx)
        self.q_proj = nn.Linear(h, config.num_attention_heads * hd, bias=config.qkv_bias)
        self.k_proj = nn.Linear(h, config.num_key_value_heads * hd, bias=config.qkv_bias)
        self.v_proj = nn.Linear(h, config.num_key_value_heads * hd, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.num_attention_heads * hd, h, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(hd, config.rms_norm_eps)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def keys_values(self, x, cos, sin, how: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys (normalised, rotated) and values of `x` (the layer's normalised input), `[b, kv_heads,
        s, head_dim]`, as `forward` computes them; `how` as `project`'s."""
        b, s, _ = x.shape
        k = project(self.k_proj, x, how).view(b, s, -1, self.head_dim)
        v = project(self.v_proj, x, how).view(b, s, -1, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return apply_rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2)

    def forward(self, x, cos, sin, mask, kv_cache=None, cache_position=None, keep: int = 0):
        """Self-attention of `x` (the layer's normalised input); `keep` > 0: the output at the last
        `keep` positions only, the keys and values (and the cache) at every position."""
        mv = getattr(kv_cache, "linears", None)
        k, v = self.keys_values(x, cos, sin, mv)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v, cache_position)
        if keep:
            x, cos, sin, mask = x[:, -keep:], cos[:, -keep:], sin[:, -keep:], last_rows(mask, keep, k.shape[2], k.device)
        b, s, _ = x.shape
        q = project(self.q_proj, x, mv).view(b, s, -1, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = apply_rope(q.transpose(1, 2), cos, sin)
        how = getattr(kv_cache, "decode_attention", None)
        if how == "reduce" and s == 1:
            out = attend_decode(q, k, v, mask, self.scale)
        elif how is not None:
            out = attend_grouped(q, k, v, mask, self.scale)
        else:
            out = attend(q, k, v, mask, self.scale)
        return project(self.o_proj, out.transpose(1, 2).reshape(b, s, -1), mv)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x, how: Optional[str] = None):
        """`how`: how the three linears compute (`project`); the plain modules when None."""
        return project(self.down_proj, F.silu(project(self.gate_proj, x, how)) * project(self.up_proj, x, how), how)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, masks, kv_cache=None, cache_position=None, keep: int = 0):
        """`keep` > 0: the output at the last `keep` positions only (see `Attention.forward`)."""
        mask = masks[self.self_attn.window]
        attn = self.self_attn(self.input_layernorm(x), cos, sin, mask, kv_cache, cache_position, keep)
        x = (x[:, -keep:] if keep else x) + attn
        return x + self.mlp(self.post_attention_layernorm(x), getattr(kv_cache, "linears", None))


# ---------------------------------------------------------------------------------------------
# masks
# ---------------------------------------------------------------------------------------------
def packed_segments(position_ids: torch.Tensor) -> torch.Tensor:
    """Document index per token of packed rows: a position that does not follow its left neighbour
    by one starts a new document (transformers' rule)."""
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


def build_masks(
    windows: set,
    batch: int,
    q_len: int,
    kv_len: int,
    device: torch.device,
    attention_mask: Optional[torch.Tensor],
    cache_position: Optional[torch.Tensor],
    segments: Optional[torch.Tensor],
) -> dict:
    """One boolean mask `[batch, 1, q_len, kv_len]` per distinct sliding window (None = full).

    Returns {window: None} when plain causal attention over a cache-less input suffices, so SDPA
    can take its `is_causal` path.
    """
    plain = attention_mask is None and segments is None and cache_position is None and q_len == kv_len
    if plain and windows == {None}:
        return {None: None}
    if cache_position is None:
        cache_position = torch.arange(q_len, device=device)
    q_pos = cache_position.view(1, 1, q_len, 1)
    k_pos = torch.arange(kv_len, device=device).view(1, 1, 1, kv_len)
    base = k_pos <= q_pos
    if attention_mask is not None:
        if attention_mask.dim() == 4:
            base = base & attention_mask.bool()
        else:
            if attention_mask.shape[-1] != kv_len:
                raise ValueError(
                    f"attention_mask covers {attention_mask.shape[-1]} positions but attention sees {kv_len} keys: "
                    f"pass a mask over the whole sequence (past and present)."
                )
            base = base & attention_mask.bool()[:, None, None, :]
    if segments is not None:
        base = base & (segments[:, None, :, None] == segments[:, None, None, :])
    masks = {}
    for window in windows:
        m = base if window is None else base & (q_pos - k_pos < window)
        m = m.expand(batch, 1, q_len, kv_len)
        masks[window] = m | ~m.any(-1, keepdim=True)  # rows that see nothing (left padding): open, unused
    return masks


# ---------------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------------
class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        # built without nn.Embedding's own init (init_weights does it): on the meta device, normal_
        # pages in ~70 MB of kernels that a load never needs
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        self.windows = {config.layer_window(i) for i in range(config.num_hidden_layers)}
        self.gradient_checkpointing = False

    def prepare(self, input_ids, attention_mask=None, position_ids=None, kv_cache=None, cache_position=None,
                inputs_embeds=None):
        """What every layer takes besides the hidden states: `(x, cos, sin, masks)` (embedded input,
        rotary tables, one mask per sliding window)."""
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        b, s = x.shape[:2]
        segments = None
        if position_ids is None:
            start = cache_position if cache_position is not None else torch.arange(s, device=x.device)
            position_ids = start.view(1, s).expand(b, s)
        elif attention_mask is None and kv_cache is None:
            segments = packed_segments(position_ids)
        kv_len = kv_cache.max_length if kv_cache is not None else s
        masks = build_masks(self.windows, b, s, kv_len, x.device, attention_mask, cache_position, segments)
        cos, sin = self.rotary_emb(position_ids, x.dtype)
        return x, cos, sin, masks

    def forward(self, input_ids, attention_mask=None, position_ids=None, kv_cache=None, cache_position=None,
                inputs_embeds=None, keep: int = 0):
        """The final hidden states; `keep` > 0: at the last `keep` positions only (`run_layers`)."""
        x, cos, sin, masks = self.prepare(input_ids, attention_mask, position_ids, kv_cache, cache_position,
                                          inputs_embeds)
        return self.norm(self.run_layers(x, cos, sin, masks, kv_cache, cache_position, keep=keep))

    def run_layers(self, x, cos, sin, masks, kv_cache=None, cache_position=None, call=None, keep: int = 0):
        """Every layer in turn (checkpointed when gradient checkpointing is on and training);
        `call(layer, x, cos, sin, masks, kv_cache, cache_position)` runs one (default: the layer
        itself; the Trainer passes its compiled layer region). `keep` > 0 (passed to the last layer's
        `call`): the last layer computes its output at the last `keep` positions alone, its keys and
        values at all of them; its output elsewhere feeds nothing, so that is one layer's attention and
        MLP saved over a prompt whose logits are wanted at its end. Not while forward hooks watch that
        layer: they see every position, as with transformers."""
        call = call or _call_layer
        last = len(self.layers) - 1
        if keep and (global_hooks() or any(hooked(m) for m in self.layers[last].modules())):
            keep = 0
        for i, layer in enumerate(self.layers):
            kept = {"keep": keep} if 0 < keep < x.shape[1] and i == last else {}
            if self.gradient_checkpointing and self.training:
                x = torch.utils.checkpoint.checkpoint(call, layer, x, cos, sin, masks, kv_cache, cache_position,
                                                      use_reentrant=False, **kept)
            else:
                x = call(layer, x, cos, sin, masks, kv_cache, cache_position, **kept)
        return x


_HOOKS = ("_forward_hooks", "_forward_pre_hooks")
_BACKWARD_HOOKS = ("_backward_hooks", "_backward_pre_hooks")


def global_hook_ids(backward: bool = False) -> tuple:
    """The handles of the hooks registered for every module, per kind (forward, and with `backward`
    backward ones); they change with each registration or removal."""
    from torch.nn.modules import module as nn_module

    names = _HOOKS + (_BACKWARD_HOOKS if backward else ())
    return tuple(tuple(getattr(nn_module, "_global" + name, None) or ()) for name in names)


def global_hooks(backward: bool = False) -> bool:
    """Whether hooks registered for every module are set (forward, and with `backward` backward ones)."""
    return any(global_hook_ids(backward))


def hooked(module: nn.Module, backward: bool = False) -> bool:
    """Whether `module` itself has forward hooks (and with `backward` backward ones): code that reads its
    weights directly, or a graph saved without them, would skip what they do."""
    names = _HOOKS + (_BACKWARD_HOOKS if backward else ())
    return any(getattr(module, name, None) for name in names)


def has_decoder_layout(model) -> bool:
    """Whether `model` is laid out as ours (`model.model.prepare`, `.run_layers`, `.layers`, `.norm`,
    `lm_head`): what the compiled single-layer regions of the Trainer and the engine need."""
    decoder = getattr(model, "model", None)
    return all(hasattr(decoder, a) for a in ("prepare", "run_layers", "layers", "norm")) and hasattr(model, "lm_head")


def _call_layer(layer, x, cos, sin, masks, kv_cache=None, cache_position=None, keep: int = 0):
    return layer(x, cos, sin, masks, kv_cache, cache_position, keep)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch=None,
                   ignore_index: int = -100) -> torch.Tensor:
    """Next-token cross-entropy in float32; labels are shifted here (as transformers does).

    With `num_items_in_batch` the summed loss is divided by it, so gradient accumulation over
    micro-batches equals one large batch.
    """
    labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:].to(logits.device)
    loss = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=ignore_index,
        reduction="sum" if num_items_in_batch is not None else "mean",
    )
    if num_items_in_batch is not None:
        loss = loss / num_items_in_batch
    return loss


class CausalLM(nn.Module):
    """A causal language model: `.model` (the decoder) and `.lm_head`, transformers' layout."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.generation_config = None  # set by loading (generation_config.json) or by the engine
        self.name_or_path = None

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: ModelConfig, dtype: Optional[torch.dtype] = None, seed: Optional[int] = None) -> "CausalLM":
        """A randomly initialised model (transformers' init: normal(0, initializer_range), norms at 1)."""
        if seed is not None:
            torch.manual_seed(seed)
        model = cls(config)
        model.init_weights()
        return model.to(dtype) if dtype is not None else model

    @classmethod
    def from_pretrained(cls, *args, **kwargs) -> "CausalLM":
        from .loading import from_pretrained

        return from_pretrained(*args, **kwargs)

    def init_weights(self) -> None:
        std = float(self.config.extra.get("initializer_range", 0.02))
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        self.tie_weights()
        self.model.rotary_emb.reset_parameters()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # ---- properties ------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def num_parameters(self) -> int:
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None) -> None:
        self.model.gradient_checkpointing = True

    def gradient_checkpointing_disable(self) -> None:
        self.model.gradient_checkpointing = False

    # ---- forward -------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        kv_cache: Any = None,
        cache_position: Optional[torch.Tensor] = None,
        logits_to_keep: Union[int, torch.Tensor] = 0,
        num_items_in_batch: Optional[Union[int, torch.Tensor]] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        use_cache: Optional[bool] = None,  # accepted for transformers compatibility; the cache is the engine's
        return_dict: Optional[bool] = None,
    ) -> CausalLMOutput:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds.")
        keep = logits_to_keep if isinstance(logits_to_keep, int) and logits_to_keep > 0 else 0
        hidden = self.model(input_ids, attention_mask, position_ids, kv_cache, cache_position, inputs_embeds,
                            keep=keep)  # the last layer computes the kept positions only
        if isinstance(logits_to_keep, int):
            if logits_to_keep > 0:
                hidden = hidden[:, -logits_to_keep:]
        else:
            hidden = hidden.index_select(1, logits_to_keep.to(hidden.device))
        logits = project(self.lm_head, hidden, getattr(kv_cache, "head_linear", None))
        loss = None
        if labels is not None:
            loss = causal_lm_loss(logits, labels, num_items_in_batch)
        return CausalLMOutput(logits=logits, loss=loss)

    # ---- saving and generating (implemented in their own modules) ------------------------------
    def save_pretrained(self, save_directory: str, max_shard_size: Union[int, str] = "5GB", **kwargs) -> None:
        from .loading import save_pretrained

        save_pretrained(self, save_directory, max_shard_size=max_shard_size, **kwargs)

    def generate(self, *args, **kwargs):
        from .generation.api import generate

        return generate(self, *args, **kwargs)

    def compile_stats(self):
        from .generation.api import compile_stats

        return compile_stats(self)
