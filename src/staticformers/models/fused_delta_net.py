"""Qwen3-Next's Gated DeltaNet: the layer of `linear_attention.py` with its input projections stored fused.

Qwen3.5 projects the input with four matrices (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`); Qwen3-Next
with two, under transformers' names, so that its checkpoints load and save by their own names and a PEFT LoRA
adapter targets them by PEFT's names:

- `in_proj_qkvz` `[key heads * (2 key dim + 2 r value dim), hidden]`: per key head, its query, its key, then the
  values and the output gates of the `r = value heads / key heads` value heads it serves;
- `in_proj_ba` `[2 value heads, hidden]`: per key head, the write-strength inputs `b` of its `r` value heads, then
  their decay inputs `a`.

(transformers' `Qwen3NextGatedDeltaNet.fix_query_key_value_ordering`.) `FusedGatedDeltaNet.projections` reorders
the two outputs into what the rest of the layer reads (all queries, all keys, all values; the gates; `b`; `a`):
reshapes, splits and one concatenation of activations, the weights untouched. `decoder.py` builds this layer where
the family says `fused_linear_projections` (`model_config.py`). The parameter count is Qwen3.5's
(`config_linear.linear_parameters`).

Being grouped per key head, both projections split under tensor parallel as plain rows: `1 / tp` of the groups is
`1 / tp` of the key heads with the value heads they serve, whole. The number of groups is read from the output
(`-1` in the reshapes), so a rank reorders its own. The convolution is held in three parts as Qwen3.5's is
(`linear_attention.py`; its checkpoints' one `conv1d` through `checkpoints/names.py`, `QWEN3_NEXT_FUSED`).
"""

from __future__ import annotations

import torch
from torch import nn

from .linear_attention import GatedDeltaNet
from .ops import Ops


class FusedGatedDeltaNet(GatedDeltaNet):
    """Gated DeltaNet with `in_proj_qkvz` and `in_proj_ba` (see the module docstring)."""

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        del self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a
        h = config.hidden_size
        keys, values = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        self.in_proj_qkvz = nn.Linear(h, 2 * keys + 2 * values, bias=False)
        self.in_proj_ba = nn.Linear(h, 2 * self.value_heads, bias=False)

    def projections(self, x: torch.Tensor, ops: Ops) -> tuple[torch.Tensor, ...]:
        """As `GatedDeltaNet.projections`, from the fused projections' per-key-head groups."""
        lead = x.shape[:-1]
        per_head = self.value_heads // self.key_heads  # value heads per key head
        per_group = per_head * self.value_dim
        qkvz, ba = ops.linear_group((self.in_proj_qkvz, self.in_proj_ba), x)
        qkvz = qkvz.reshape(*lead, -1, 2 * (self.key_dim + per_group))  # [..., key heads (this rank's), group]
        q, k, v, z = qkvz.split([self.key_dim, self.key_dim, per_group, per_group], dim=-1)
        mixed = torch.cat([t.reshape(*lead, -1) for t in (q, k, v)], dim=-1)
        b, a = ba.reshape(*lead, -1, 2 * per_head).chunk(2, dim=-1)
        return mixed, z.reshape(*lead, -1), b.reshape(*lead, -1), a.reshape(*lead, -1)


__all__ = ["FusedGatedDeltaNet"]
