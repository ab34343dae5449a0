"""What a running cache of a hybrid model adds for steps that do not advance every row by every token they run.

A linear-attention layer (`linear_attention.py`) folds every token it is given into its row's recurrent state, and
the state cannot be moved back. Two kinds of step give it tokens that must not all count:

- **Steps where some rows only take part.** A decode step runs every slot, a chunk of a prompt runs every row
  (`generation/chunking.py`), and a chunk is padded after the prompt's end. `count(last)` says, per row, the index
  of the last token of the step that counts (-1: none, `ALL`: every one); the decoder turns it into the `valid`
  mask the layers read (`decoder.valid_positions`, through the cache's `last_index`), and the state goes through
  the others unchanged (`gated_delta.py`).
- **Speculative verification** (`generation/speculative/step.py`): a row runs `[last, d_1 .. d_k]` and keeps what
  it accepts, which is known only after the step. The cache keeps one state per position of a step up to
  `width` tokens wide (`record`), and `roll_back(index)` puts, per row, the state after its `index`-th token in
  place (-1: the row keeps the state the step left). vLLM's Gated DeltaNet keeps a state per speculative token
  in the same way; recomputing instead would run the step twice.

`RollbackStates` holds those buffers for a `kv_cache.KVCache` (one per cache, `width` 0 when no speculation runs
on it): per linear layer, `[slots, width, channels, kernel - 1]` conv states and `[slots, width, heads, key dim,
value dim]` float32 recurrent states.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

ALL = 2**30  # `count`'s "every token of the step counts"


class RollbackStates:
    """The per-row counted index and the per-position states of one cache (see the module docstring)."""

    def __init__(self, batch: int, linear: dict, width: int, dtype: torch.dtype, device: torch.device):
        self.width = int(width)
        self.last_index = torch.full((batch,), ALL, dtype=torch.long, device=device)
        self._counted: list = [ALL] * batch  # what `last_index` holds, on the host
        self.conv = (
            {i: torch.zeros((batch, self.width, *conv), dtype=dtype, device=device) for i, (conv, _) in linear.items()}
            if self.width
            else {}
        )
        self.recurrent = (
            {
                i: torch.zeros((batch, self.width, *rec), dtype=torch.float32, device=device)
                for i, (_, rec) in linear.items()
            }
            if self.width
            else {}
        )

    @staticmethod
    def bytes_for(linear: dict, width: int, dtype: torch.dtype) -> int:
        """What one row costs here, in bytes: its counted index, and its states per position."""
        if not linear:
            return 0
        return 8 + width * sum(math.prod(conv) * dtype.itemsize + math.prod(rec) * 4 for conv, rec in linear.values())

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.last_index, *self.conv.values(), *self.recurrent.values()]

    def count(self, last: Sequence[int]) -> None:
        """Each row's last counted token for the next step (see the module docstring); copied to the device only
        when it changed."""
        last = [int(i) for i in last]
        if last != self._counted:
            self.last_index.copy_(torch.tensor(last, dtype=torch.long))
            self._counted = last

    def record(self, layer: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Layer `layer`'s states after each of a step's tokens, in place (`record_states`)."""
        record_states(self.conv[layer], self.recurrent[layer], conv, recurrent)

    def roll_back(self, states: dict, index: torch.Tensor) -> None:
        """Put each row's recorded state after its `index`-th token (`[slots]` on the device; -1: leave the row)
        into `states` ({layer: (conv, recurrent)}, the cache's running states), in place."""
        rows = torch.arange(index.shape[0], device=index.device)
        at = index.clamp(min=0)
        chosen = index >= 0
        for layer, (conv, recurrent) in states.items():
            for state, each in ((conv, self.conv[layer]), (recurrent, self.recurrent[layer])):
                keep = chosen.view(-1, *[1] * (state.dim() - 1))
                state.copy_(torch.where(keep, each[rows, at], state))


def record_states(
    conv_each: torch.Tensor, recurrent_each: torch.Tensor, conv: torch.Tensor, recurrent: torch.Tensor
) -> None:
    """A layer's states after each of a step's `s` tokens (`[slots, s, ...]`, s <= width) into its buffers."""
    s = conv.shape[1]
    conv_each[:, :s].copy_(conv)
    recurrent_each[:, :s].copy_(recurrent)


__all__ = ["ALL", "RollbackStates", "record_states"]
