"""Which proposed tokens a row keeps: the target's choice at every verified position, per row.

Why a module of its own: the verify step returns the target's logits at the k+1 positions of each row
(`[n, k+1, vocab]`); what the row would have chosen at position j depends on the tokens before it,
which include the proposals 1..j. So each position is processed as its own row would be processed by
`RowSampler.choose`, in the same order (repetition, presence and frequency penalties, min-new-tokens,
then temperature, top-k, top-p, min-p), with the penalty state advanced by the proposals before it
(the counts of generated tokens plus the one-hot counts of proposals 1..j).

- **Greedy rows** keep proposals while each equals the target's argmax after the row's processors;
  at the first mismatch (or after the last proposal) they take the target's token there. The output
  is the output without speculation, token for token.
- **Sampling rows** use the standard rejection rule (Leviathan et al. 2023, Chen et al. 2023): accept
  proposal d at position j with probability min(1, p_j(d) / q_j(d)), and at the first rejection draw
  from norm(max(0, p_j - q_j)); after the last accepted proposal of a row that accepted them all,
  draw from p. For prompt lookup q is one-hot at d (accept with probability p_j(d); the residual is
  p_j without d). Each token's distribution is then the target's. Every draw (the uniform of each
  acceptance, the exponential race of each draw) comes from the row's own generator, in a fixed
  order, so a seeded request stays reproducible.

`accept_rule` and `residual` are module-level so a test can swap the rule and see the test fail.

Grammar masks (structured output) apply at every verified position: `allowed` takes a `[n, k+1, vocab]`
bool mask (True: allowed) and is applied where `RowSampler.choose` would apply the row's mask; the
loop passes None until per-row masks exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..sampling import NEG_INF, RowSampler, min_p, repetition_penalty, temperature, top_k, top_p, warped


def accept_rule(p_d: torch.Tensor, q_d: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Accept with probability min(1, p/q): `u ~ U[0, 1)`, accept when `u * q < p`."""
    return u * q_d < p_d


def residual(p: torch.Tensor, q: Optional[torch.Tensor], drafts: torch.Tensor) -> torch.Tensor:
    """max(0, p - q) (unnormalised; the exponential race normalises); q None: one-hot at `drafts`."""
    if q is None:
        return p.scatter(-1, drafts.unsqueeze(-1), 0.0)
    return (p - q).clamp_min(0.0)


@dataclass
class Verdict:
    """Per row: how many proposals it accepted and the tokens it emits (the accepted proposals, then the
    target's token at the first position it did not accept); `ids` `[n, k+1]` on the host, each row's
    emitted tokens first (the rest repeat its last token)."""

    accepted: list
    tokens: list
    ids: torch.Tensor


def scores(
    sampler: RowSampler,
    logits: torch.Tensor,
    rows: Sequence[int],
    steps: Sequence[int],
    drafts: torch.Tensor,
    allowed: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The rows' processed logits at every verified position, `[n * T, vocab]` (row-major), and, when a
    row samples, the sampling distributions there (the module docstring); `drafts` `[n, T-1]` on the
    device, `steps[i]` the tokens row i had generated before this step."""
    n, width, vocab = logits.shape
    t = sampler._table(tuple(rows))
    x = logits.float()
    if t["penalised"]:
        idx = t["index"]
        before = torch.nn.functional.one_hot(drafts, vocab).to(torch.int32).cumsum(1)  # proposals 1..j
        counts = sampler.counts.index_select(0, idx).unsqueeze(1) + torch.cat(
            [torch.zeros(n, 1, vocab, dtype=torch.int32, device=x.device), before], 1
        )
        seen = sampler.prompt_seen.index_select(0, idx).unsqueeze(1) | (counts > 0)
        x = repetition_penalty(x, seen & t["rep_on"].unsqueeze(1), t["rep"].unsqueeze(1))
        c = counts.float()
        x = x - t["frequency"].unsqueeze(1) * c - t["presence"].unsqueeze(1) * (c > 0).float()
    banned = [
        (i, j)
        for i, (r, s) in enumerate(zip(rows, steps))
        for j in range(width)
        if s + j < sampler.params[r].min_new_tokens and sampler.params[r].eos_token_ids
    ]
    if banned:  # made on the host, as RowSampler.choose makes its mask
        mask = torch.zeros(n, width, vocab, dtype=torch.bool)
        for i, j in banned:
            mask[i, j, [e for e in sampler.params[rows[i]].eos_token_ids if 0 <= e < vocab]] = True
        x = x.masked_fill(mask.to(x.device), NEG_INF)
    if allowed is not None:  # the structured-output hook: per row and position
        x = x.masked_fill(~allowed.to(x.device), NEG_INF)
    x = x.reshape(n * width, vocab)
    if not t["sampling"]:
        return x, None

    def each(column: torch.Tensor) -> torch.Tensor:  # a per-row table, one entry per verified position
        return column.repeat_interleave(width, dim=0)

    y = x
    if t["temperature"] is not None:
        y = temperature(y, each(t["temperature"]))
    if t["top_k"] is not None:
        y = top_k(y, each(t["top_k"]), largest=t["top_k_max"])
    if t["top_p"] is not None:
        y = top_p(y, each(t["top_p_on"]), threshold=each(t["top_p"]))
    if t["min_p"] is not None:
        y = min_p(y, each(t["min_p"]))
    return x, torch.softmax(y, dim=-1)


def draft_distribution(sampler: RowSampler, logits: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """A draft model's sampling distribution for `rows` (`[n, vocab]` logits, padded to the target's
    vocabulary): the rows' temperature, top-k, top-p and min-p. Any q is exact under the rejection rule;
    the row's own warping makes q closer to p, so more proposals are accepted."""
    return warped(logits.float(), sampler._table(tuple(rows)))


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """A draw from each row of `probs` (unnormalised) with Exp(1) `noise`: the exponential race."""
    return torch.where(probs > 0, probs / noise, -1.0).argmax(dim=-1)


def _noise(sampler: RowSampler, row: int, shape: tuple, kind: str) -> torch.Tensor:
    device = "cpu" if sampler.host_generators else sampler.device
    out = torch.empty(shape, device=device)
    g = sampler.generators[row]
    out.exponential_(generator=g) if kind == "exp" else out.uniform_(generator=g)
    return out


def _uniforms(sampler: RowSampler, row: int, k: int, proposed: int) -> torch.Tensor:
    """A row's acceptance uniforms `[k]`: drawn when it proposed something, none drawn otherwise."""
    if proposed == 0:
        return torch.zeros(k, device="cpu" if sampler.host_generators else sampler.device)
    return _noise(sampler, row, (k,), "uniform")


def _race_noise(sampler: RowSampler, row: int, vocab: int) -> torch.Tensor:
    """A row's exponential noise for its one draw of this step, `[vocab]`: the draw a decode step makes for
    it. A row draws once per step whatever it accepted (at the position where it stops), so a seeded row's
    stream does not depend on whether the step was a verify or a decode step (which other rows decide), and
    a verify draws `vocab` exponentials per row, not `(k+1) * vocab`."""
    return _noise(sampler, row, (vocab,), "exp")


def verify(
    sampler: RowSampler,
    logits: torch.Tensor,
    argmax: torch.Tensor,
    rows: Sequence[int],
    steps: Sequence[int],
    proposals: Sequence[Sequence[int]],
    q: Optional[torch.Tensor] = None,
    allowed: Optional[torch.Tensor] = None,
) -> Verdict:
    """Each row's accepted proposals and next token (the module docstring). `logits` `[n, T, vocab]` and
    `argmax` `[n, T]` from the verify step (the rows' own, in `rows` order); `proposals[i]`: at most T-1
    tokens; `q` `[n, T-1, vocab]`: the draft's distributions (None: a deterministic proposal)."""
    n, width, vocab = logits.shape
    k = width - 1
    drafts = torch.zeros(n, k, dtype=torch.long)
    for i, p in enumerate(proposals):
        drafts[i, : len(p)] = torch.as_tensor(list(p), dtype=torch.long)
    counts = [len(p) for p in proposals]
    device = logits.device
    sample_rows: list = []
    if not sampler.needs_logits(rows) and allowed is None:
        chosen = argmax
    else:
        d = drafts.to(device)
        x, probs = scores(sampler, logits, rows, steps, d, allowed)
        chosen = x.argmax(-1).view(n, width)
        t = sampler._table(tuple(rows))
        sample_rows = t["sample_rows"] if probs is not None else []
    accept = None
    if sample_rows:
        probs = probs.view(n, width, vocab)
        idx = torch.tensor(sample_rows, dtype=torch.long, device=device)
        p = probs.index_select(0, idx)  # [s, T, V]
        ds = d.index_select(0, idx)
        qs = q.index_select(0, idx).float() if q is not None else None
        p_d = p[:, :k].gather(2, ds.unsqueeze(-1)).squeeze(-1)
        q_d = qs.gather(2, ds.unsqueeze(-1)).squeeze(-1) if qs is not None else torch.ones_like(p_d)
        u = torch.stack([_uniforms(sampler, rows[i], k, counts[i]) for i in sample_rows]).to(device)
        accept_s = accept_rule(p_d, q_d, u)
        # where each sampling row stops: its first proposal not accepted (or after its last one); its one draw
        # is made there, from the residual after a rejection, from p after its last proposal
        s_counts = torch.tensor([counts[i] for i in sample_rows], dtype=torch.long, device=device)
        held = accept_s & (torch.arange(k, device=device) < s_counts.unsqueeze(-1))
        at = held.long().cumprod(-1).sum(-1)  # [s]: accepted proposals before the first one not accepted
        s_index = torch.arange(len(sample_rows), device=device)
        p_at = p[s_index, at]  # [s, V]
        rejected = at < s_counts
        before = at.clamp(max=k - 1)  # the proposal rejected there (unused where none was)
        rest = residual(p_at, qs[s_index, before] if qs is not None else None, ds[s_index, before])
        # p == q leaves no residual; then nothing is ever rejected there, and p stands in
        rest = torch.where(rest.sum(-1, keepdim=True) > 0, rest, p_at)
        dist = torch.where(rejected.unsqueeze(-1), rest, p_at)
        noise = torch.stack([_race_noise(sampler, rows[i], vocab) for i in sample_rows]).to(device)
        drawn = race(dist, noise)  # [s]
        rows_chosen = chosen.index_select(0, idx)
        rows_chosen[s_index, at] = drawn
        chosen = chosen.index_copy(0, idx, rows_chosen)
        accept = torch.zeros(n, k, dtype=torch.bool, device=device).index_copy(0, idx, accept_s)
    chosen = chosen.cpu()
    accept = accept.cpu() if accept is not None else None
    sampled = set(sample_rows)
    accepted, tokens = [], []
    ids = torch.zeros(n, width, dtype=torch.long)
    for i in range(n):
        a = 0
        while a < counts[i]:
            ok = bool(accept[i, a]) if i in sampled else int(drafts[i, a]) == int(chosen[i, a])
            if not ok:
                break
            a += 1
        out = drafts[i, :a].tolist() + [int(chosen[i, a])]
        accepted.append(a)
        tokens.append(out)
        ids[i, : len(out)] = torch.tensor(out)
        ids[i, len(out) :] = out[-1]
    return Verdict(accepted, tokens, ids)


__all__ = ["Verdict", "accept_rule", "residual", "scores", "draft_distribution", "race", "verify"]
