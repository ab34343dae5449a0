"""The prompt's log-probabilities, computed inside a prefill graph as fixed-shape outputs.

Why this exists: evaluation harnesses score a model by the log-probability of given text (OpenAI's
`echo` with `logprobs`, lm-evaluation-harness's loglikelihood). A prefill already runs every prompt
position through the model; a *scoring* prefill (step kind `"score"`) also sends every position
through the head, not only each row's last token, and returns from the same graph:

- `token_logprobs` `[b, L]`: at position `j >= 1`, the log-probability of token `j` given tokens
  `0..j-1` (position 0 has no prediction: 0, to be reported as null);
- `top_logprobs`, `top_ids` `[b, L, TOP]`: at position `j >= 1`, the `TOP` most likely tokens there,
  best first (position 0: what follows no token, meaningless, dropped by the caller).

`TOP` is fixed (OpenAI's and vLLM's largest `logprobs`), so the outputs' shapes depend on the prefill
bucket alone: a request asking for fewer reads a prefix. Log-softmax runs in float32 whatever the
model's dtype, as transformers' `log_softmax(logits.float())` in an evaluation does.
"""

from __future__ import annotations

import torch

TOP = 20  # the most top log-probabilities a request may ask for (`logprobs` <= 20)


def prompt_scores(logits: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`logits` `[b, L, vocab]` at every prompt position, `input_ids` `[b, L]`: `(token_logprobs [b, L],
    top_logprobs [b, L, TOP], top_ids [b, L, TOP])` as the module docstring defines them."""
    logp = torch.log_softmax(logits.float(), dim=-1)[:, :-1]  # position j-1 predicts token j
    picked = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # [b, L-1]
    top_values, top_ids = torch.topk(logp, min(TOP, logp.shape[-1]), dim=-1)
    zero = picked.new_zeros(picked.shape[0], 1)
    token_logprobs = torch.cat([zero, picked], dim=1)
    top_values = torch.cat([top_values.new_zeros(top_values.shape[0], 1, top_values.shape[-1]), top_values], dim=1)
    top_ids = torch.cat([top_ids.new_zeros(top_ids.shape[0], 1, top_ids.shape[-1]), top_ids], dim=1)
    return token_logprobs, top_values, top_ids


__all__ = ["TOP", "prompt_scores"]
