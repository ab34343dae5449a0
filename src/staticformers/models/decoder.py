"""The one decoder behind Qwen3, Llama, Qwen2, Mistral, Phi-3, GLM-4, Granite, SmolLM3, Gemma 2, Gemma 3,
OLMo 2, Qwen3-MoE, Mixtral, gpt-oss, DeepSeek-V3, Qwen3.5 and Qwen3-Next, and its output type.

Families differ only by flags read from `ModelConfig` (q/k RMSNorm, biases, RoPE variant, partial or
interleaved rotation and layers without RoPE (`rope_variants.py`), tied embeddings, sliding window) and by
the MLP each layer gets: a dense `MLP`, or a mixture of experts (`moe.SparseMoeBlock`) on the layers
`config.layer_is_sparse` names. Further flags of a family row: the norm's flavour (`norm_variants.py`) and
where the norms sit (`DecoderLayer.placement`: before attention and MLP, also after each (Gemma), or after
each only (OLMo 2); GLM-4's own post-sub-layer norms), q/k norm over the whole projection, embeddings scaled
by sqrt(hidden) (Gemma) or Granite's multipliers, GELU-tanh, `query_pre_attn_scalar`, soft caps on attention
scores (through `ops.attention(..., softcap=)`) and on the logits, gpt-oss's attention sinks (a learned
logit per head in each softmax, `ops.attention(..., sinks=)`, `attention_sinks.py`), and Gemma 3's second RoPE for its sliding
layers (`prepare` then hands the layers `{"global": ..., "local": ...}` tables; each layer takes its own).
DeepSeek-V3's layers attend through multi-head latent attention (`latent_attention.py`: one latent per
position in the cache) and route with its grouped sigmoid router beside shared experts (`moe.py`).
Qwen3.5's linear-attention layers are Gated DeltaNet (`linear_attention.py`, `DecoderLayer.linear`): a
recurrent state per request in the cache, and the positions they count in `masks["valid"]` (the real tokens
of a padded batch, or of a prompt bucket); its full-attention layers gate their output (`Attention.gated`).
Qwen3-Next's are the same layers with their input projections fused (`fused_delta_net.py`).
The building blocks that other modules share live beside this file: `RMSNorm` (`norm_variants.py`),
`apply_rope` (`rope_variants.py`), and keeping some positions only (`kept_positions.py`).

Module and parameter names mirror transformers' (`model.layers.0.self_attn.q_proj.weight`,
`mlp.experts.gate_up_proj`), so a dense Hugging Face state dict loads with no renaming and ours saves
back (the Hub's per-expert and fused names are mapped by `checkpoints/names.py`).

This file is the architecture and nothing else: no device checks, no kernel choices, no parallelism,
no compile calls, no loading or generation. What callers may change comes in through two arguments:

- `ops` (`ops.Ops`): how projections and attention are computed. The plain path (the modules
  themselves, PyTorch's SDPA) is the default; a backend passes its own formulation per shape.
- `kv_cache`: an object with `max_length` and `update(layer_idx, k, v, position_ids) -> (keys,
  values)`. The generation engine's cache writes each row's keys and values at that row's own
  positions (`models/kv_cache.py`); its index *is* the position, so masks over a cache follow
  from `position_ids` alone.

Masks are booleans `[batch, 1, queries, keys]`, one per distinct sliding window, built once per
forward: causal over a cache from each row's positions; without a cache from the sequence index, the
2-D padding mask when one is given, and, for packed training rows, document boundaries found in
`position_ids` (a position that does not follow its left neighbour starts a document, as
transformers does). A row of queries that may see nothing (left padding) is opened fully so that no
NaN leaks; its output is never used. Heads are read from the weights' shapes at run time (`-1` in
views), so a tensor-parallel plan that shards q/k/v column-wise needs nothing from this file.

`keep` (an int, or per-row indices `[batch, n]`) asks for the output at some positions only: the
last layer then computes its keys and values everywhere and its attention and MLP at those positions
(a prompt's logits are wanted at its end), one layer of prompt work saved.

A sparse layer also produces its router logits (`DecoderLayer.forward(..., routed=True)`); with `output_router_logits`
the model collects them, returns them and its load-balancing loss (`aux_loss`, added to the loss times
`router_aux_loss_coef` when labels are given), as transformers does.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from .model_config import ModelConfig
from .hooks import global_hooks, hooked
from .attention_sinks import local_sinks
from .latent_attention import LatentAttention
from .fused_delta_net import FusedGatedDeltaNet
from .linear_attention import GatedDeltaNet
from .moe import Experts, GroupedRouter, SparseMoeBlock, load_balancing_loss
from .kept_positions import Keep, kept_rows, take
from .norm_variants import NORM_CLASSES, ROUNDED_DTYPES, RMSNorm, embedding_scale, make_norm, softcap
from .ops import PLAIN, Ops
from . import rope_variants
from .rope_variants import apply_rope

if TYPE_CHECKING:  # the type alone: a layout is applied from outside (staticformers.distributed)
    from ..distributed.mesh import ParallelDims


# ---------------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------------
@dataclass
class CausalLMOutput:
    """`.logits` `[batch, seq, vocab]` (or the kept positions) and `.loss` when labels were given; for a
    mixture of experts with `output_router_logits`, `.aux_loss` and `.router_logits` (one `[batch * seq,
    experts]` tensor per sparse layer)."""

    logits: torch.Tensor
    loss: Optional[torch.Tensor] = None
    aux_loss: Optional[torch.Tensor] = None
    router_logits: Optional[tuple] = None

    def __getitem__(self, key: Union[str, int]) -> Any:
        if isinstance(key, int):
            return self.to_tuple()[key]
        return getattr(self, key)

    def keys(self):
        return [k for k in ("loss", "aux_loss", "logits", "router_logits") if getattr(self, k) is not None]

    def to_tuple(self) -> tuple:
        return tuple(getattr(self, k) for k in self.keys())


# ---------------------------------------------------------------------------------------------
# building blocks
# ---------------------------------------------------------------------------------------------
def rope_inv_freq(config: ModelConfig, device: Optional[torch.device] = None, long: bool = False) -> torch.Tensor:
    """Inverse frequencies for the config's RoPE variant (default, linear, llama3, yarn, longrope: its short
    factors, or its `long` ones), over the rotated dims (`config.rotary_dim`)."""
    dim = config.rotary_dim
    if config.rope_type == "longrope":
        return rope_variants.longrope_inv_freq(config, long, device)
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
    scaling, dim, base = config.rope_scaling, config.rotary_dim, config.rope_theta
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
    if scaling.get("rope_type") == "longrope":
        return rope_variants.longrope_attention_factor(config)
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


def local_rope_config(config: ModelConfig) -> ModelConfig:
    """`config` with the sliding layers' RoPE (`config.rope_local`) as its own: what their tables are built from."""
    local = dict(config.rope_local)
    theta = local.pop("rope_theta")
    scaling = None if local.get("rope_type") == "default" else local
    return dataclasses.replace(config, rope_theta=theta, rope_scaling=scaling)


class RotaryEmbedding(nn.Module):
    """cos/sin for given positions; `inv_freq` (and LongRoPE's `long_inv_freq`) are non-persistent buffers
    rebuilt after meta init. The tables cover the rotated dims, in GLM's interleaved layout for GLM-4."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.interleaved = config.rope_interleaved
        # computed on the CPU even under a meta-device context: pow on meta pages in kernels a load never needs
        self.register_buffer("inv_freq", rope_inv_freq(config, device=torch.device("cpu")), persistent=False)
        if config.rope_type == "longrope":
            self.register_buffer(
                "long_inv_freq", rope_inv_freq(config, torch.device("cpu"), long=True), persistent=False
            )
        self.attention_factor = rope_attention_factor(config)

    def reset_parameters(self, device: Optional[torch.device] = None) -> None:
        """Recompute the frequencies (on `device`, else where they are): a meta-built model's last step."""
        device = device if device is not None else self.inv_freq.device
        self.inv_freq = rope_inv_freq(self.config, device=device)
        if self.config.rope_type == "longrope":
            self.long_inv_freq = rope_inv_freq(self.config, device=device, long=True)

    def forward(
        self, position_ids: torch.Tensor, dtype: torch.dtype, long: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`long`: LongRoPE's long factors (`rope_variants.uses_long_factors`)."""
        inv_freq = self.long_inv_freq if long else self.inv_freq
        freqs = position_ids[..., None].float() * inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        if self.interleaved:
            cos, sin = rope_variants.interleave(cos), rope_variants.interleave(sin)
        return cos.to(dtype), sin.to(dtype)


def _kept(keep: Optional[Keep], seq: int) -> Optional[Keep]:
    """`keep` when it selects fewer positions than there are, else None (everything is wanted)."""
    if keep is None:
        return None
    if isinstance(keep, int):
        return keep if 0 < keep < seq else None
    return keep


# ---------------------------------------------------------------------------------------------
# the layers
# ---------------------------------------------------------------------------------------------
class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        h, hd = config.hidden_size, config.head_dim
        self.layer_idx = layer_idx
        self.head_dim = hd
        if config.attention_multiplier is not None:  # Granite
            self.scale = config.attention_multiplier
        else:
            self.scale = (config.query_pre_attn_scalar or hd) ** -0.5
        self.softcap = config.attention_softcap
        self.window = config.layer_window(layer_idx)
        self.rope = config.layer_uses_rope(layer_idx)  # False: a SmolLM3 layer without RoPE
        self.interleaved = config.rope_interleaved
        self.gated = config.family.gated_attention  # Qwen3.5: each head's query, then its output gate
        self.q_proj = nn.Linear(h, config.num_attention_heads * hd * (2 if self.gated else 1), bias=config.qkv_bias)
        self.k_proj = nn.Linear(h, config.num_key_value_heads * hd, bias=config.qkv_bias)
        self.v_proj = nn.Linear(h, config.num_key_value_heads * hd, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.num_attention_heads * hd, h, bias=config.o_bias)
        # q/k norm per head (Qwen3, Gemma 3), or over the whole projection before the heads split (OLMo 2)
        self.qk_norm_whole = config.family.qk_norm_over == "projection"
        if config.qk_norm:
            q_dim, k_dim = (
                (config.num_attention_heads * hd, config.num_key_value_heads * hd) if self.qk_norm_whole else (hd, hd)
            )
            self.q_norm = make_norm(config.family.norm, q_dim, config.rms_norm_eps, RMSNorm)
            self.k_norm = make_norm(config.family.norm, k_dim, config.rms_norm_eps, RMSNorm)
        else:
            self.q_norm = self.k_norm = None
        # gpt-oss: one sink logit per query head (attention_sinks.py)
        self.sinks = nn.Parameter(torch.empty(config.num_attention_heads)) if config.family.attention_sinks else None

    def keys_values(self, x, cos, sin, ops: Ops = PLAIN) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys (normalised, rotated) and values of `x` (the layer's normalised input), `[b, kv_heads,
        s, head_dim]`, as `forward` computes them."""
        k, v = ops.linear_group((self.k_proj, self.v_proj), x)
        return self.rotated_keys_values(k, v, cos, sin)

    def rotated_keys_values(self, k, v, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """The projected keys and values `[b, s, kv_heads * head_dim]` as attention reads them: `[b, kv_heads,
        s, head_dim]`, the keys normalised and rotated."""
        b, s, _ = k.shape
        if self.k_norm is not None and self.qk_norm_whole:
            k = self.k_norm(k)
        k, v = k.view(b, s, -1, self.head_dim), v.view(b, s, -1, self.head_dim)
        if self.k_norm is not None and not self.qk_norm_whole:
            k = self.k_norm(k)
        k = k.transpose(1, 2)
        return (apply_rope(k, cos, sin, self.interleaved) if self.rope else k), v.transpose(1, 2)

    def forward(
        self, x, cos, sin, mask, kv_cache=None, position_ids=None, ops: Ops = PLAIN, keep: Optional[Keep] = None
    ):
        """Self-attention of `x` (the layer's normalised input); `keep`: the output at the kept positions
        only, the keys and values (and the cache) at every position. Without `keep`, q, k and v are one
        `ops.linear_group` call (a backend may compute them in one pass over their input)."""
        if keep is None:
            q, k, v = ops.linear_group((self.q_proj, self.k_proj, self.v_proj), x)
            k, v = self.rotated_keys_values(k, v, cos, sin)
        else:
            k, v = self.keys_values(x, cos, sin, ops)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v, position_ids)
        if keep is not None:
            x, cos, sin, mask = (
                take(x, keep),
                take(cos, keep),
                take(sin, keep),
                kept_rows(mask, keep, k.shape[2], k.device),
            )
            q = ops.linear(self.q_proj, x)
        b, s, _ = q.shape
        gate = None
        if self.gated:
            q, gate = q.view(b, s, -1, 2 * self.head_dim).chunk(2, dim=-1)
            q, gate = q.reshape(b, s, -1), gate.reshape(b, s, -1)
        if self.q_norm is not None and self.qk_norm_whole:
            q = self.q_norm(q)
        q = q.view(b, s, -1, self.head_dim)
        if self.q_norm is not None and not self.qk_norm_whole:
            q = self.q_norm(q)
        q = q.transpose(1, 2)
        if self.rope:
            q = apply_rope(q, cos, sin, self.interleaved)
        extra = {} if self.sinks is None else {"sinks": local_sinks(self.sinks)}
        out = ops.attention(q, k, v, mask, self.scale, softcap=self.softcap, **extra).transpose(1, 2).reshape(b, s, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return ops.linear(self.o_proj, out)


class MLP(nn.Module):
    """The gated MLP; `width`: its intermediate size (default `intermediate_size`; DeepSeek's shared experts
    are `n_shared_experts * moe_intermediate_size` wide)."""

    def __init__(self, config: ModelConfig, width: Optional[int] = None):
        super().__init__()
        h, i, bias = config.hidden_size, width or config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        self.tanh_gelu = config.hidden_act == "gelu_pytorch_tanh"  # Gemma; otherwise SiLU

    def forward(self, x, ops: Ops = PLAIN):
        gate, up = ops.linear_group((self.gate_proj, self.up_proj), x)
        act = F.gelu(gate, approximate="tanh") if self.tanh_gelu else F.silu(gate)
        return ops.linear(self.down_proj, act * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        fam, h, eps = config.family, config.hidden_size, config.rms_norm_eps
        self.placement = fam.norm_placement  # "pre", "sandwich" (Gemma) or "post" (OLMo 2)
        # the norms each placement has, by transformers' names (post_attention_layernorm: before the MLP
        # for "pre", after attention otherwise)
        self.input_layernorm = make_norm(fam.norm, h, eps, RMSNorm) if self.placement != "post" else None
        self.linear = config.layer_is_linear(layer_idx)  # Qwen3.5's Gated DeltaNet layers
        if self.linear:
            self.linear_attn = (FusedGatedDeltaNet if fam.fused_linear_projections else GatedDeltaNet)(
                config, layer_idx
            )
        else:
            self.self_attn = (
                LatentAttention(config, layer_idx) if config.latent_attention else Attention(config, layer_idx)
            )
        self.post_attention_layernorm = make_norm(fam.norm, h, eps, RMSNorm)
        if self.placement == "sandwich":
            self.pre_feedforward_layernorm = make_norm(fam.norm, h, eps, RMSNorm)
        if self.placement != "pre":
            self.post_feedforward_layernorm = make_norm(fam.norm, h, eps, RMSNorm)
        self.sparse = config.layer_is_sparse(layer_idx)
        if self.sparse:
            shared = (
                MLP(config, config.n_shared_experts * config.moe_intermediate_size) if config.n_shared_experts else None
            )
            gated = MLP(config, config.shared_expert_intermediate_size) if config.family.gated_shared_expert else None
            self.mlp = SparseMoeBlock(config, shared, gated)
        else:
            self.mlp = MLP(config)
        self.rope = rope_key(config, layer_idx)
        if config.family.post_sublayer_norms:  # GLM-4's norms of attention's and the MLP's outputs
            self.post_self_attn_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.post_mlp_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        else:
            self.post_self_attn_layernorm = self.post_mlp_layernorm = None
        self.residual_multiplier = config.residual_multiplier  # Granite's scale of each sub-layer's output
        # the MLP half is `r + mlp(norm(r))` with `r = x + attn`, which a formulation may compute in one call
        # (`Ops.mlp_block`)
        self.plain_mlp_half = (
            self.placement == "pre"
            and not self.sparse
            and self.post_self_attn_layernorm is None
            and self.post_mlp_layernorm is None
            and self.residual_multiplier == 1.0
        )

    @property
    def kind(self) -> tuple:
        """What makes two layers run the same code: the attention window and the MLP kind (layers of one
        kind share a compiled layer region), which RoPE where sliding layers rotate with their own (Gemma 3),
        "norope" for a layer without RoPE (SmolLM3), and "sinks" for attention with sinks (gpt-oss)."""
        if self.linear:
            return (None, "moe" if self.sparse else "dense", "linear")
        kind = (self.self_attn.window, "moe" if self.sparse else "dense")
        if self.rope is not None:
            kind += (self.rope,)
        if not self.self_attn.rope:
            kind += ("norope",)
        return kind + (("sinks",) if self.self_attn.sinks is not None else ())

    def attention_input(self, x):
        """What attention reads: the normalised input (no norm before attention for OLMo 2)."""
        return x if self.input_layernorm is None else self.input_layernorm(x)

    def _residual(self, x: torch.Tensor, out: torch.Tensor, norm: Optional[nn.Module]) -> torch.Tensor:
        """`x` plus a sub-layer's output `out` (normed first where the family norms it, scaled by Granite's
        residual_multiplier)."""
        if norm is not None:
            out = norm(out)
        if self.residual_multiplier != 1.0:
            out = out * self.residual_multiplier
        return x + out

    def keys_values(self, x, cos, sin, ops: Ops = PLAIN) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values this layer's attention computes from the layer's input `x` (what `forward`
        writes into a cache), without the rest of the layer."""
        if self.linear:
            raise ValueError(
                f"Layer {self.linear_attn.layer_idx} is linear attention: it keeps a recurrent state, "
                f"not keys and values."
            )
        cos, sin = rope_tables(cos, sin, self.rope)
        return self.self_attn.keys_values(self.attention_input(x), cos, sin, ops)

    def forward(
        self,
        x,
        cos,
        sin,
        masks,
        kv_cache=None,
        position_ids=None,
        ops: Ops = PLAIN,
        keep: Optional[Keep] = None,
        routed: bool = False,
    ):
        """`keep`: the output at the kept positions only (see `Attention.forward`). `routed`: return `(x,
        router logits)`, the logits None for a dense layer (through the module's call, so that hooks,
        FSDP's among them, run as for any other call)."""
        if self.linear:
            attn = self.linear_attn(self.attention_input(x), masks.get(VALID), kv_cache, ops, keep)
        else:
            mask = masks[self.self_attn.window]
            cos, sin = rope_tables(cos, sin, self.rope)
            attn = self.self_attn(self.attention_input(x), cos, sin, mask, kv_cache, position_ids, ops, keep)
        if self.placement != "pre":
            attn = self.post_attention_layernorm(attn)
        if keep is not None:
            x = take(x, keep)
        if self.plain_mlp_half:
            fused = ops.mlp_block(self.post_attention_layernorm, self.mlp, x, attn)
            if fused is not None:
                return (fused, None) if routed else fused
        x = self._residual(x, attn, self.post_self_attn_layernorm)
        logits = None
        if self.placement == "pre":
            h = self.post_attention_layernorm(x)
        else:
            h = self.pre_feedforward_layernorm(x) if self.placement == "sandwich" else x
        if self.sparse:
            out, logits = self.mlp(h, ops)
        else:
            out = self.mlp(h, ops)
        if self.placement != "pre":
            out = self.post_feedforward_layernorm(out)
        x = self._residual(x, out, self.post_mlp_layernorm)
        return (x, logits) if routed else x


def rope_key(config: ModelConfig, layer_idx: int) -> Optional[str]:
    """Which RoPE tables a layer reads: None where every layer shares one; "local" or "global" where
    sliding layers have their own (Gemma 3's `rope_local`)."""
    if config.rope_local is None:
        return None
    return "local" if config.layer_window(layer_idx) is not None else "global"


def rope_tables(cos, sin, key: Optional[str]):
    """A layer's cos/sin: the tensors themselves, or its own from the `{key: tensor}` that `prepare` builds
    for a model with two RoPEs."""
    if isinstance(cos, dict):
        return cos[key], sin[key]
    return cos, sin


# ---------------------------------------------------------------------------------------------
# masks
# ---------------------------------------------------------------------------------------------
VALID = "valid"  # the masks' key of the positions linear-attention layers count ([batch, seq] bool, or None: all)


def valid_positions(
    seq: int, device, attention_mask: Optional[torch.Tensor] = None, kv_cache=None
) -> Optional[torch.Tensor]:
    """The tokens the linear-attention layers count: a 2-D `attention_mask`'s ones; over a cache that says each row's
    last counted token (`last_index`: a prompt-only cache's last prompt token, a running hybrid cache's
    `KVCache.count`), each row's tokens up to it; None (all of them) otherwise."""
    if attention_mask is not None and attention_mask.dim() == 2:
        return attention_mask[:, -seq:].bool()
    last = kv_cache.last_index if kv_cache is not None else None
    if last is not None:
        return torch.arange(seq, device=device).view(1, seq) <= last.view(-1, 1).to(device)
    return None


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
    attention_mask: Optional[torch.Tensor] = None,
    q_positions: Optional[torch.Tensor] = None,
    segments: Optional[torch.Tensor] = None,
) -> dict:
    """One boolean mask `[batch, 1, q_len, kv_len]` per distinct sliding window (None = full).

    `q_positions` `[batch, q_len]`: each query's index in the keys (a cache's index is the position);
    None: the sequence index. Returns {window: None} when plain causal attention without a cache
    suffices, so SDPA can take its `is_causal` path.
    """
    plain = attention_mask is None and segments is None and q_positions is None and q_len == kv_len
    if plain and windows == {None}:
        return {None: None}
    if q_positions is None:
        q_pos = torch.arange(q_len, device=device).view(1, 1, q_len, 1)
    else:
        q_pos = q_positions.view(q_positions.shape[0], 1, q_len, 1)
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
        # pages in kernels that a load never needs
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = make_norm(config.family.norm, config.hidden_size, config.rms_norm_eps, RMSNorm)
        self.rotary_emb = RotaryEmbedding(config)
        # Gemma 3: the sliding layers' RoPE (its own base and scaling)
        self.rotary_local = RotaryEmbedding(local_rope_config(config)) if config.rope_local is not None else None
        # sqrt(hidden) rounded per dtype here, eagerly: inside a traced graph the rounding (a tensor read back as
        # a float) would break the graph on runtimes that cannot fold it (torch_xla's dynamo)
        scale = config.hidden_size**0.5
        self.embed_scales = (
            {dtype: embedding_scale(scale, dtype) for dtype in ROUNDED_DTYPES}
            if config.family.scaled_embedding
            else None
        )
        self.windows = {config.layer_window(i) for i in range(config.num_hidden_layers)}
        self.linear = config.has_linear_attention
        self.embedding_multiplier = config.embedding_multiplier
        self.gradient_checkpointing = False

    def prepare(self, input_ids, attention_mask=None, position_ids=None, kv_cache=None, inputs_embeds=None):
        """What every layer takes besides the hidden states: `(x, cos, sin, masks)` (embedded input,
        rotary tables, one mask per sliding window)."""
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if self.embed_scales is not None and inputs_embeds is None:  # as transformers: not given embeddings
            x = x * self.embed_scales[x.dtype]
        if self.embedding_multiplier != 1.0:  # Granite
            x = x * self.embedding_multiplier
        b, s = x.shape[:2]
        segments = q_positions = None
        if position_ids is None:
            rope_positions = torch.arange(s, device=x.device).view(1, s).expand(b, s)
        else:
            rope_positions = position_ids
            if kv_cache is not None:
                q_positions = position_ids  # each row's own positions are its cache indices
            elif attention_mask is None:
                segments = packed_segments(position_ids)
        kv_len = kv_cache.max_length if kv_cache is not None else s
        masks = build_masks(self.windows, b, s, kv_len, x.device, attention_mask, q_positions, segments)
        if self.linear:  # which positions the linear-attention layers count (`linear_attention.py`)
            masks = {**masks, VALID: valid_positions(s, x.device, attention_mask, kv_cache)}
        long = rope_variants.uses_long_factors(self.rotary_emb.config, kv_len)
        cos, sin = self.rotary_emb(rope_positions, x.dtype, long=long)
        if self.rotary_local is not None:
            local_cos, local_sin = self.rotary_local(rope_positions, x.dtype)
            cos, sin = {"global": cos, "local": local_cos}, {"global": sin, "local": local_sin}
        return x, cos, sin, masks

    def forward(
        self,
        input_ids,
        attention_mask=None,
        position_ids=None,
        kv_cache=None,
        inputs_embeds=None,
        keep: Optional[Keep] = None,
        ops: Ops = PLAIN,
        router_logits: Optional[list] = None,
    ):
        """The final hidden states; `keep`: at the kept positions only (`run_layers`); `router_logits`: a
        list that collects each sparse layer's router logits."""
        x, cos, sin, masks = self.prepare(input_ids, attention_mask, position_ids, kv_cache, inputs_embeds)
        return self.norm(
            self.run_layers(x, cos, sin, masks, kv_cache, position_ids, keep=keep, ops=ops, router_logits=router_logits)
        )

    def reset_rope(self, device: Optional[torch.device] = None) -> None:
        """Recompute every RoPE's frequencies (on `device`, else where they are): a meta-built model's last step."""
        self.rotary_emb.reset_parameters(device)
        if self.rotary_local is not None:
            self.rotary_local.reset_parameters(device)

    def effective_keep(self, keep: Optional[Keep], seq: int) -> Optional[Keep]:
        """`keep` as `run_layers` applies it: None when it keeps every position, or while forward hooks
        watch the last layer (they see every position, as with transformers)."""
        keep = _kept(keep, seq)
        if keep is not None and (global_hooks() or any(hooked(m) for m in self.layers[-1].modules())):
            return None
        return keep

    def run_layers(
        self,
        x,
        cos,
        sin,
        masks,
        kv_cache=None,
        position_ids=None,
        call=None,
        keep: Optional[Keep] = None,
        ops: Ops = PLAIN,
        router_logits: Optional[list] = None,
    ):
        """Every layer in turn (checkpointed when gradient checkpointing is on and training). A layer
        runs through its module call (`DecoderLayer.forward`), or through `call(layer, x, cos, sin, masks,
        kv_cache, position_ids, ops)` when given (a compiled region of that forward: the Trainer's).
        `keep` (see `effective_keep`; passed to the last layer's run): the last layer computes its
        output at the kept positions alone, its keys and values at all of them. `router_logits`: a list
        to which each sparse layer's router logits are appended; each run then returns `(x, logits or
        None)`."""
        routed = router_logits is not None
        last = len(self.layers) - 1
        keep = self.effective_keep(keep, x.shape[1])
        for i, layer in enumerate(self.layers):
            kw = {"keep": keep} if keep is not None and i == last else {}
            if call is None:
                fn, args = layer, (x, cos, sin, masks, kv_cache, position_ids, ops)
                if routed:
                    kw["routed"] = True
            else:
                fn, args = call, (layer, x, cos, sin, masks, kv_cache, position_ids, ops)
            if self.gradient_checkpointing and self.training:
                out = torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kw)
            else:
                out = fn(*args, **kw)
            if routed:
                x, logits = out
                if logits is not None:
                    router_logits.append(logits)
            else:
                x = out
        return x


def causal_lm_loss(
    logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch=None, ignore_index: int = -100
) -> torch.Tensor:
    """Next-token cross-entropy in float32; labels are shifted here (as transformers does).

    With `num_items_in_batch` the summed loss is divided by it, so gradient accumulation over
    micro-batches equals one large batch.
    """
    labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:].to(logits.device)
    loss = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        ignore_index=ignore_index,
        reduction="sum" if num_items_in_batch is not None else "mean",
    )
    if num_items_in_batch is not None:
        loss = loss / num_items_in_batch
    return loss


class CausalLM(nn.Module):
    """A causal language model: `.model` (the decoder) and `.lm_head`, transformers' layout.

    The architecture alone; `staticformers.api.auto.ModelForCausalLM` (what `from_pretrained` returns)
    adds loading, saving and generation. `parallel_dims` is the layout a model was partitioned with
    (`staticformers.distributed.mesh.ParallelDims`, set by `distributed.parallelize`), None in one process;
    `data_parallel` (set there too when several ranks see distinct batches) sums the router statistics
    of the load-balancing loss over those ranks (`moe.load_balancing_loss`).
    """

    parallel_dims: Optional["ParallelDims"] = None
    data_parallel: Any = None

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.generation_config = None  # set by loading (generation_config.json) or by the engine
        self.name_or_path = None
        self.parallel_dims = None
        self.data_parallel = None

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: ModelConfig, dtype: Optional[torch.dtype] = None, seed: Optional[int] = None):
        """A randomly initialised model (transformers' init: normal(0, initializer_range), norms at 1)."""
        if seed is not None:
            torch.manual_seed(seed)
        model = cls(config)
        model.init_weights()
        return model.to(dtype) if dtype is not None else model

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
            elif isinstance(module, NORM_CLASSES):
                module.reset_parameters()
            elif isinstance(module, Experts):
                module.reset_parameters(std)
            elif isinstance(module, GatedDeltaNet):
                module.reset_parameters()
            elif isinstance(module, Attention) and module.sinks is not None:
                nn.init.normal_(module.sinks, mean=0.0, std=std)
            elif isinstance(module, GroupedRouter):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                nn.init.zeros_(module.e_score_correction_bias)
        self.tie_weights()
        self.model.reset_rope()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _apply(self, fn, recurse=True):
        """`to()`, `float()`, ... and then the tie again: a conversion that cannot reuse the tensors (the CPU to
        an XLA device) gives each module a new parameter, and tied weights would train as two."""
        out = super()._apply(fn, recurse)
        head, embed = self.lm_head.weight, self.model.embed_tokens.weight
        if (
            self.config.tie_word_embeddings
            and head is not embed
            and head.shape == embed.shape
            and head.device == embed.device
        ):
            self.tie_weights()
        return out

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
        logits_to_keep: Union[int, torch.Tensor] = 0,
        num_items_in_batch: Optional[Union[int, torch.Tensor]] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        use_cache: Optional[bool] = None,  # accepted for transformers compatibility; the cache is the engine's
        return_dict: Optional[bool] = None,
        ops: Optional[Ops] = None,
        keep_index: Optional[torch.Tensor] = None,
        output_router_logits: Optional[bool] = None,
    ) -> CausalLMOutput:
        """transformers' forward. `logits_to_keep`: an int (the last n positions) or 1-D indices shared by
        every row; `keep_index` (ours) `[batch, n]`: per-row indices of the positions whose logits are
        wanted (a right-padded batch's last tokens). `ops`: how projections and attention compute.
        `output_router_logits` (default: the config's): a mixture of experts returns its router logits and
        load-balancing loss, added to the loss (times `router_aux_loss_coef`) when labels are given."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds.")
        ops = ops if ops is not None else PLAIN
        seq = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        if keep_index is not None:
            keep: Optional[Keep] = keep_index
        elif isinstance(logits_to_keep, int):
            keep = logits_to_keep if logits_to_keep > 0 else None
        else:
            batch = (input_ids if input_ids is not None else inputs_embeds).shape[0]
            keep = logits_to_keep.to(self.device).view(1, -1).expand(batch, -1)
        config = self.config
        if output_router_logits is None:
            output_router_logits = config.output_router_logits
        router = [] if output_router_logits and config.is_moe else None
        # what the last layer computes (all of it when its router logits are wanted); the rest is taken here
        trimmed = self.model.effective_keep(keep, seq) if router is None else None
        hidden = self.model(
            input_ids,
            attention_mask,
            position_ids,
            kv_cache,
            inputs_embeds,
            keep=trimmed,
            ops=ops,
            router_logits=router,
        )
        wanted = _kept(keep, seq)
        if wanted is not None and trimmed is None:
            hidden = take(hidden, wanted)
        return self.head(hidden, labels, num_items_in_batch, ops, router, attention_mask)

    def head(
        self,
        hidden: torch.Tensor,
        labels: Optional[torch.Tensor] = None,
        num_items_in_batch: Optional[Union[int, torch.Tensor]] = None,
        ops: Ops = PLAIN,
        router_logits: Optional[Union[list, tuple]] = None,
        attention_mask: Optional[torch.Tensor] = None,
    ) -> CausalLMOutput:
        """What `forward` computes from the decoder's output `hidden` (the final norm applied): the
        logits (`lm_head`, through `ops.head`); with `labels`, the loss (`causal_lm_loss`); with
        `router_logits` (the sparse layers' own, in layer order), the load-balancing loss, added to the
        loss times `router_aux_loss_coef` (a 2-D `attention_mask` keeps padding out of its statistics;
        with `num_items_in_batch` it is this batch's share of a summed loss, `moe.load_balancing_loss`).
        DeepSeek-V3 balances its experts with the router's correction bias, not a loss: no `aux_loss`, as
        transformers returns none for it."""
        logits = softcap(ops.head(self.lm_head, hidden), self.config.final_logit_softcapping)
        if self.config.logits_scaling != 1.0:  # Granite
            logits = logits / self.config.logits_scaling
        loss = aux = None
        if labels is not None:
            loss = causal_lm_loss(logits, labels, num_items_in_batch)
        if router_logits and self.config.family.router != "grouped_sigmoid":  # DeepSeek: no auxiliary loss
            config = self.config
            mask = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
            aux = load_balancing_loss(
                router_logits,
                config.num_experts,
                config.num_experts_per_tok,
                mask,
                self.data_parallel,
                share=num_items_in_batch is not None,
            )
            if loss is not None:
                loss = loss + config.router_aux_loss_coef * aux.to(loss.device)
        return CausalLMOutput(
            logits=logits,
            loss=loss,
            aux_loss=aux,
            router_logits=tuple(router_logits) if router_logits is not None else None,
        )
