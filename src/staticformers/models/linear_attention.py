"""Gated DeltaNet, the linear-attention layer of Qwen3.5 (and Qwen3-Next), under transformers' module names.

Per token, the layer projects the input into queries, keys and values (`in_proj_qkv`, one causal depthwise
convolution over the three with SiLU, `conv1d`), an output gate `z` (`in_proj_z`), and per value head a write
strength `beta = sigmoid(in_proj_b x)` and a log decay `g = -exp(A_log) * softplus(in_proj_a x + dt_bias)`. The
gated delta rule (`gated_delta.py`) turns them into each head's output, which is RMS-normalised, multiplied by
`silu(z)` (`norm`, transformers' `RMSNormGated`) and projected back (`out_proj`).

What a request carries from one step to the next is fixed-size: the convolution's last `kernel - 1` inputs and
the recurrent state `[value heads, key dim, value dim]` (float32). `state_shapes` in `config_linear.py` gives
both. A cache hands them in and takes them back through the interface the decoder's attention uses for keys
and values:

- no cache (a training or scoring forward): the state starts at zero and is dropped;
- a prompt-only cache (`kv_cache.PrefillKV`): it starts at zero, and the states after each row's last token are
  handed to `update(layer, conv_state, recurrent_state, None)`, as attention hands its keys and values;
- a running cache (`kv_cache.KVCache`, `LayerKV`): `state(layer)` gives the rows' states, one token per row is
  run in the recurrent form, and `update` writes the new states in place.

A prompt runs in the chunked form, a decode step (one token) in the recurrent form. `valid` `[batch, seq]`
(None: every position) marks the real tokens of a padded batch: the layer reads zeros at the others (as
transformers zeroes padded positions before it), and the state is left as it was there (`gated_delta.py`).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .gated_delta import causal_conv, chunked_gated_delta, recurrent_gated_delta
from .kept_positions import Keep, take
from .ops import PLAIN, Ops

CHUNK = 64  # tokens per chunk of the chunked form (transformers' and flash-linear-attention's default)


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's output (weight applied in the input's dtype), times `silu(gate)` in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (h * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer (see the module docstring). Attributes the decoder layer reads of any token
    mixer: `window` (None), `rope` (False), `sinks` (None)."""

    window = None
    rope = False
    sinks = None

    def __init__(self, config, layer_idx: int):
        super().__init__()
        h = config.hidden_size
        self.layer_idx = layer_idx
        self.key_heads, self.key_dim = config.linear_num_key_heads, config.linear_key_head_dim
        self.value_heads, self.value_dim = config.linear_num_value_heads, config.linear_value_head_dim
        keys, values = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        self.channels = 2 * keys + values
        self.in_proj_qkv = nn.Linear(h, self.channels, bias=False)
        self.in_proj_z = nn.Linear(h, values, bias=False)
        self.in_proj_b = nn.Linear(h, self.value_heads, bias=False)
        self.in_proj_a = nn.Linear(h, self.value_heads, bias=False)
        kernel = config.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(self.channels, self.channels, kernel, groups=self.channels, bias=False,
                                padding=kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.value_heads))
        self.A_log = nn.Parameter(torch.zeros(self.value_heads))
        self.norm = GatedRMSNorm(self.value_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(values, h, bias=False)

    def reset_parameters(self) -> None:
        """transformers' init of the parameters no linear init covers: dt_bias ones, A_log the log of U(0, 16)."""
        nn.init.ones_(self.dt_bias)
        with torch.no_grad():
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0, 16).log())
        nn.init.ones_(self.norm.weight)

    def forward(self, x: torch.Tensor, valid: Optional[torch.Tensor] = None, kv_cache=None, ops: Ops = PLAIN,
                keep: Optional[Keep] = None) -> torch.Tensor:
        """The layer's output for `x` (the normalised input `[b, s, hidden]`); with `keep`, at the kept positions
        only (the state still runs over every position)."""
        b, s, _ = x.shape
        if valid is not None:  # padded positions read zeros, as transformers zeroes them before this layer
            x = x * valid.unsqueeze(-1).to(x.dtype)
        state = kv_cache.state(self.layer_idx) if kv_cache is not None else None
        conv_state, recurrent = state if state is not None else (None, None)
        mixed = ops.linear(self.in_proj_qkv, x).transpose(1, 2)
        mixed, conv_state = causal_conv(mixed, self.conv1d.weight, conv_state, valid)
        q, k, v = mixed.transpose(1, 2).split([self.key_heads * self.key_dim] * 2 + [self.value_heads * self.value_dim],
                                              dim=-1)
        q, k = q.reshape(b, s, self.key_heads, self.key_dim), k.reshape(b, s, self.key_heads, self.key_dim)
        v = v.reshape(b, s, self.value_heads, self.value_dim)
        beta = ops.linear(self.in_proj_b, x).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(ops.linear(self.in_proj_a, x).float() + self.dt_bias)
        if s == 1 and state is not None:
            out, recurrent = recurrent_gated_delta(q, k, v, g, beta, recurrent, valid)
        else:
            out, recurrent = chunked_gated_delta(q, k, v, g, beta, recurrent, valid, CHUNK)
        if kv_cache is not None:
            kv_cache.update(self.layer_idx, conv_state, recurrent, None)
        z = ops.linear(self.in_proj_z, x).reshape(b, s, self.value_heads, self.value_dim)
        out = self.norm(out, z).reshape(b, s, -1)
        if keep is not None:
            out = take(out, keep)
        return ops.linear(self.out_proj, out)


__all__ = ["GatedDeltaNet", "GatedRMSNorm", "CHUNK"]
