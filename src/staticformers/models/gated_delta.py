"""The gated delta rule (Gated DeltaNet, the linear attention of Qwen3.5 and Qwen3-Next) in plain PyTorch, in the
two forms a static-shape engine needs, and the causal convolution in front of it.

A linear-attention layer keeps, per request, a recurrent state `S` `[heads, key_dim, value_dim]` whatever the
length, and per token `t`: `S <- exp(g_t) S`, then `S <- S + beta_t k_t (v_t - S^T k_t)^T` (the delta rule:
only what `S` does not already predict of `v_t` is written), and the output is `S^T q_t`. Queries and keys are
L2-normalised, queries scaled by `key_dim ** -0.5`, and the state is float32, as transformers' reference
functions (`torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`) compute it.

- `recurrent_gated_delta`: token by token; what a decode step (one token a row) runs.
- `chunked_gated_delta`: the same result a chunk of `chunk_size` tokens at a time (the WY/UT form: a chunk's
  updates become the inverse of a unit lower triangular system, `unit_lower_inverse`, and a few matmuls, the
  state carried from chunk to chunk); what a prompt or a training batch runs. Its shapes depend on the
  sequence's length alone.
- `causal_conv`: the depthwise causal convolution (kernel `K`) over the projected q/k/v channels, SiLU after,
  continuing from a conv state (the `K - 1` inputs before the first token) and returning the next one.

**Positions that are not there.** A static shape pads: a prompt shorter than its bucket (after it), a batch
whose rows are left-padded (before them). `valid` `[batch, seq]` (None: every position) marks the real ones.
At the others the inputs to the convolution are zero (transformers zeroes padded hidden states), and `g` and
`beta` are zero, so the state goes through unchanged: neither decayed nor written. The conv state returned is
the last `K - 1` inputs up to each row's last valid position. A row whose positions are all valid gets
exactly transformers' result.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

L2_EPS = 1e-6  # transformers' l2norm (flash-linear-attention's)


def l2norm(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class _ContiguousGrad(torch.autograd.Function):
    """The identity, whose backward hands back a contiguous gradient. The inputs below are transposed, so their
    gradients arrive transposed; the projections before them view their gradient as a matrix, which AOTAutograd
    traces as a `view` that a transposed tensor cannot take."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _prepare(q, k, v, g, beta, valid):
    """[b, s, h, d] inputs -> float32 [b, h, s, d] (keys' heads repeated to the values'), q and k L2-normalised,
    q scaled; g and beta [b, h, s], zero where not `valid`."""
    heads = v.shape[2]
    if k.shape[2] != heads:  # each query/key head serves heads / key_heads consecutive value heads
        q = q.repeat_interleave(heads // q.shape[2], dim=2)
        k = k.repeat_interleave(heads // k.shape[2], dim=2)
    q, k, v, g, beta = (_ContiguousGrad.apply(t).transpose(1, 2).float().contiguous() for t in (q, k, v, g, beta))
    if valid is not None:
        keep = valid[:, None, :].to(g.device)
        g, beta = g.masked_fill(~keep, 0.0), beta.masked_fill(~keep, 0.0)
    q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def recurrent_gated_delta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: Optional[torch.Tensor] = None,
    valid: Optional[torch.Tensor] = None,
    each: bool = False,
) -> tuple[torch.Tensor, ...]:
    """q, k `[b, s, key_heads, dk]`, v `[b, s, heads, dv]`, g (log decay, <= 0) and beta `[b, s, heads]`, state
    `[b, heads, dk, dv]` (None: zeros) -> (output `[b, s, heads, dv]` in v's dtype, the float32 state after); with
    `each`, also the state after every token, `[b, s, heads, dk, dv]`."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, valid)
    b, h, s, dk = k.shape
    state = torch.zeros(b, h, dk, v.shape[-1], dtype=torch.float32, device=v.device) if state is None else state.float()
    outs, states = [], []
    for t in range(s):
        state = state * g[:, :, t].exp()[..., None, None]
        k_t = k[:, :, t]
        predicted = (state * k_t.unsqueeze(-1)).sum(-2)  # S^T k
        delta = (v[:, :, t] - predicted) * beta[:, :, t].unsqueeze(-1)
        state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append((state * q[:, :, t].unsqueeze(-1)).sum(-2))
        states.append(state)
    out = torch.stack(outs, dim=2).transpose(1, 2).contiguous().to(dtype)
    return (out, state, torch.stack(states, dim=1)) if each else (out, state)


def chunked_gated_delta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: Optional[torch.Tensor] = None,
    valid: Optional[torch.Tensor] = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`recurrent_gated_delta`'s result, `chunk_size` tokens at a time (the sequence padded to a multiple of it
    with positions that change nothing)."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, valid)
    b, h, s, dk = k.shape
    dv = v.shape[-1]
    pad = -s % chunk_size
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    n = (s + pad) // chunk_size
    q, k, v = (t.reshape(b, h, n, chunk_size, t.shape[-1]) for t in (q, k, v))
    g, beta = g.reshape(b, h, n, chunk_size), beta.reshape(b, h, n, chunk_size)
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    decay = g.cumsum(-1)  # log of the decay from the chunk's start to each position
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    pairwise = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    lower = ((k_beta @ k.transpose(-1, -2)) * pairwise).tril(-1)  # the system is I + lower
    within = (q @ k.transpose(-1, -2)) * pairwise
    inverse = unit_lower_inverse(lower)
    u = inverse @ v_beta
    w = inverse @ (k_beta * decay.exp().unsqueeze(-1))
    q_decayed = q * decay.exp().unsqueeze(-1)
    k_to_end = k * (decay[..., -1:] - decay).exp().unsqueeze(-1)
    chunk_decay = decay[..., -1].exp()[..., None, None]
    state = torch.zeros(b, h, dk, dv, dtype=torch.float32, device=v.device) if state is None else state.float()
    outs = []
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ state
        outs.append(q_decayed[:, :, i] @ state + within[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ v_new
    out = torch.stack(outs, dim=2).reshape(b, h, n * chunk_size, dv)[:, :, :s]
    return out.transpose(1, 2).contiguous().to(dtype), state


def unit_lower_inverse(lower: torch.Tensor) -> torch.Tensor:
    """`(I + lower)^-1` for strictly lower triangular `lower` `[..., c, c]`: as `lower` is nilpotent, the inverse is
    the finite sum of `(-lower)^j` for j < c, computed as the product of `I + (-lower)^(2^i)` (log2(c) squarings
    and products). Matmuls only, so every compiler and device takes it (a triangular solve is not lowered
    everywhere: torch_xla runs it outside the graph)."""
    c = lower.shape[-1]
    power = -lower
    result = torch.eye(c, dtype=lower.dtype, device=lower.device) + power
    reach = 2
    while reach < c:
        power = power @ power
        result = result + result @ power
        reach *= 2
    return result


def causal_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    state: Optional[torch.Tensor] = None,
    valid: Optional[torch.Tensor] = None,
    each: bool = False,
) -> tuple[torch.Tensor, ...]:
    """x `[b, channels, s]` (zeroed where not `valid`), weight `[channels, K]` or `nn.Conv1d`'s `[channels, 1, K]`,
    state `[b, channels, K - 1]` (None: zeros) -> (SiLU of the depthwise causal convolution `[b, channels, s]`, the
    next state: the `K - 1` inputs up to each row's last valid position); with `each`, also the state after every
    position, `[b, s, channels, K - 1]` (what a valid position's successors would read)."""
    b, c, s = x.shape
    weight = weight if weight.dim() == 3 else weight.unsqueeze(1)
    width = weight.shape[-1] - 1
    if valid is not None:
        x = x.masked_fill(~valid[:, None, :].to(x.device), 0.0)
    before = torch.zeros(b, c, width, dtype=x.dtype, device=x.device) if state is None else state.to(x.dtype)
    full = torch.cat([before, x], dim=-1)  # [b, c, K - 1 + s]
    out = F.conv1d(full.to(weight.dtype), weight, groups=c)[..., :s]
    if valid is None:
        new_state = full[..., -width:] if width else full[..., :0]
    elif s == 1:  # a decode step: the window moves on in the rows that count the token, stays in the others
        new_state = torch.where(valid.to(x.device)[:, :, None], full[..., 1:], before)
    else:  # the K - 1 inputs ending at each row's last valid position (`full` index end - 1 + width)
        after = torch.arange(1, s + 1, device=x.device).view(1, s)
        end = (valid.to(x.device).long() * after).amax(-1)  # one past each row's last valid position (0: none)
        idx = end.view(b, 1, 1) + torch.arange(width, device=x.device).view(1, 1, width)
        new_state = full.gather(-1, idx.expand(b, c, width))
    if each:  # after position j: the inputs j + 1 - (K - 1) .. j, `full` indices j + 1 .. j + K - 1
        windows = torch.stack([full[..., j + 1 : j + 1 + width] for j in range(s)], dim=1)
        return F.silu(out).to(x.dtype), new_state, windows
    return F.silu(out).to(x.dtype), new_state


__all__ = ["l2norm", "recurrent_gated_delta", "chunked_gated_delta", "unit_lower_inverse", "causal_conv", "L2_EPS"]
