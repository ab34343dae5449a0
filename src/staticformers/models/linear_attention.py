"""Gated DeltaNet, the linear-attention layer of Qwen3.5 (and Qwen3-Next), under transformers' module names (two of
them held in parts, see below).

Per token, the layer projects the input into queries, keys and values (`in_proj_qkv`, one causal depthwise
convolution over the three with SiLU, `conv1d`), an output gate `z` (`in_proj_z`), and per value head a write
strength `beta = sigmoid(in_proj_b x)` and a log decay `g = -exp(A_log) * softplus(in_proj_a x + dt_bias)`. The
gated delta rule (`gated_delta.py`) turns them into each head's output, which is RMS-normalised, multiplied by
`silu(z)` (`norm`, transformers' `RMSNormGated`) and projected back (`out_proj`).

transformers holds `in_proj_qkv` and `conv1d` as one matrix each, rows `[all queries | all keys | all values]`.
Here each is held as its three parts (`in_proj_qkv.q`, `.k`, `.v`; `conv1d.q`, `.k`, `.v`), as Phi-3's fused
`qkv_proj` is: checkpoints still read and write transformers' fused tensors (`checkpoints/names.py`, `QWEN3_5_FUSED`),
a LoRA adapter still targets PEFT's `in_proj_qkv` (`adapters/fused_targets.py`), and tensor parallel splits each
part by its own heads as a plain row split (`distributed/parallelize.py`), which a fused matrix's three segments
could not be: a DTensor shard, and a checkpoint's chunk of it, is one contiguous block of rows.

Head counts are read from the tensors at run time, never from the config: under tensor parallel a rank holds
`1 / tp` of the key heads with the value heads they serve (its rows of every projection, of `A_log`, `dt_bias` and
the convolution, which are DTensors whose local part `local_part` reads), and its state is as many heads.

What a request carries from one step to the next is fixed-size: the convolution's last `kernel - 1` inputs and
the recurrent state `[value heads, key dim, value dim]` (float32). `state_shapes` in `config_linear.py` gives
both. A cache hands them in and takes them back through the interface the decoder's attention uses for keys
and values:

- no cache (a training or scoring forward): the state starts at zero and is dropped;
- a prompt-only cache (`kv_cache.PrefillKV`): it starts at zero, and the states after each row's last token are
  handed to `update(layer, conv_state, recurrent_state, None)`, as attention hands its keys and values;
- a running cache (`kv_cache.KVCache`, `LayerKV`): `state(layer)` gives the rows' states, one token per row is
  run in the recurrent form, and `update` writes the new states in place. Several tokens per row (an extend step:
  a chunk of a prompt) run in the chunked form from the rows' states; a step no wider than the cache's
  `rollback_width` (a speculative verification) runs in the recurrent form and also hands the states after each
  token to `record(layer, conv_states, recurrent_states)`, so that each row keeps what it accepts.

`valid` `[batch, seq]` (None: every position) marks the tokens that count: the real tokens of a padded batch, and
in a running cache each row's tokens up to its `last_index` (`state_rollback.py`). The layer reads zeros at the
others (as transformers zeroes padded positions before it), and the state is left as it was there
(`gated_delta.py`).
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
PARTS = ("q", "k", "v")  # the parts of `in_proj_qkv` and `conv1d`, in transformers' row order


def local_part(t: torch.Tensor) -> torch.Tensor:
    """`t`, or its local part when tensor parallel made it a DTensor sharded over the heads."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def _depthwise(channels: int, kernel: int) -> nn.Conv1d:
    return nn.Conv1d(channels, channels, kernel, groups=channels, bias=False, padding=kernel - 1)


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
    chunk_size = CHUNK  # tokens per chunk of the chunked form (a plan's `linear_chunk`, set by the engine)

    def __init__(self, config, layer_idx: int):
        super().__init__()
        h = config.hidden_size
        self.layer_idx = layer_idx
        # the whole layer's head counts (a rank under tensor parallel reads its own from its tensors)
        self.key_heads, self.key_dim = config.linear_num_key_heads, config.linear_key_head_dim
        self.value_heads, self.value_dim = config.linear_num_value_heads, config.linear_value_head_dim
        keys, values = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        widths = dict(zip(PARTS, (keys, keys, values)))
        self.in_proj_qkv = nn.ModuleDict({p: nn.Linear(h, n, bias=False) for p, n in widths.items()})
        self.in_proj_z = nn.Linear(h, values, bias=False)
        self.in_proj_b = nn.Linear(h, self.value_heads, bias=False)
        self.in_proj_a = nn.Linear(h, self.value_heads, bias=False)
        kernel = config.linear_conv_kernel_dim
        self.conv1d = nn.ModuleDict({p: _depthwise(n, kernel) for p, n in widths.items()})
        self.dt_bias = nn.Parameter(torch.ones(self.value_heads))
        self.A_log = nn.Parameter(torch.zeros(self.value_heads))
        self.norm = GatedRMSNorm(self.value_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(values, h, bias=False)

    def reset_parameters(self) -> None:
        """transformers' init of the parameters no linear init covers: dt_bias ones, A_log the log of U(0.01, 16)."""
        nn.init.ones_(self.dt_bias)
        with torch.no_grad():
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0.01, 16).log())
        nn.init.ones_(self.norm.weight)

    def projections(self, x: torch.Tensor, ops: Ops) -> tuple[torch.Tensor, ...]:
        """(the convolution's input `[b, s, channels]`: queries, keys and values of every head in that order, the
        output gate `z` `[b, s, values]`, the write-strength and decay inputs `b`, `a` `[b, s, value heads]`); the
        heads are this rank's under tensor parallel."""
        q, k, v, z, b, a = ops.linear_group(
            (*self.in_proj_qkv.values(), self.in_proj_z, self.in_proj_b, self.in_proj_a), x
        )
        return torch.cat([q, k, v], dim=-1), z, b, a

    def conv_weight(self) -> torch.Tensor:
        """The convolution's weight `[channels, 1, K]` over the queries, keys and values this rank computes."""
        return torch.cat([local_part(part.weight) for part in self.conv1d.values()])

    def forward(
        self,
        x: torch.Tensor,
        valid: Optional[torch.Tensor] = None,
        kv_cache=None,
        ops: Ops = PLAIN,
        keep: Optional[Keep] = None,
    ) -> torch.Tensor:
        """The layer's output for `x` (the normalised input `[b, s, hidden]`); with `keep`, at the kept positions
        only (the state still runs over every position)."""
        b, s, _ = x.shape
        if valid is not None:  # padded positions read zeros, as transformers zeroes them before this layer
            x = x * valid.unsqueeze(-1).to(x.dtype)
        state = kv_cache.state(self.layer_idx) if kv_cache is not None else None
        conv_state, recurrent = state if state is not None else (None, None)
        # a step a speculative verification may roll back keeps the states after each of its tokens (`state_rollback.py`)
        each = state is not None and 1 < s <= kv_cache.rollback_width
        mixed, z, b_proj, a_proj = self.projections(x, ops)
        mixed, conv_state, *conv_each = causal_conv(mixed.transpose(1, 2), self.conv_weight(), conv_state, valid, each)
        values = z.shape[-1]  # the value heads' channels this rank computes (the gate has one per value channel)
        keys = (mixed.shape[1] - values) // 2
        q, k, v = mixed.transpose(1, 2).split([keys, keys, values], dim=-1)
        q, k = q.reshape(b, s, -1, self.key_dim), k.reshape(b, s, -1, self.key_dim)
        v = v.reshape(b, s, -1, self.value_dim)
        beta = b_proj.sigmoid()
        g = -local_part(self.A_log).float().exp() * F.softplus(a_proj.float() + local_part(self.dt_bias))
        if (s == 1 or each) and state is not None:
            out, recurrent, *recurrent_each = recurrent_gated_delta(q, k, v, g, beta, recurrent, valid, each)
        else:
            out, recurrent = chunked_gated_delta(q, k, v, g, beta, recurrent, valid, self.chunk_size)
        if kv_cache is not None:
            kv_cache.update(self.layer_idx, conv_state, recurrent, None)
        if each:
            kv_cache.record(self.layer_idx, conv_each[0], recurrent_each[0])
        out = self.norm(out, z.reshape(b, s, -1, self.value_dim)).reshape(b, s, -1)
        if keep is not None:
            out = take(out, keep)
        return ops.linear(self.out_proj, out)


__all__ = ["GatedDeltaNet", "GatedRMSNorm", "CHUNK", "PARTS", "local_part"]
