"""What the XLA tests share: the plan (few shapes: each costs an XLA compilation) and transformers' greedy run."""

from __future__ import annotations

import torch

from staticformers import ShapePlan

PLAN = dict(batch_sizes=[4], prompt_lengths=[32], kv_lengths=[40], max_model_len=40)


def plan() -> ShapePlan:
    return ShapePlan(**PLAN)


def hf_greedy(hf, prompt: list, n: int) -> list:
    ids = torch.tensor([prompt])
    out = hf.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()
