"""The tolerances tests compare numbers with, each derived from what the computation can promise.

A tolerance that holds on one CPU and fails on another is a defect: the same fp32 math evaluated in
another order (another library's kernels, fused or compiled code, another layout of ranks summing
their parts, another CPU's vector width) rounds differently. The rounding error of a sum is relative
to the size of what is summed, so values far from zero (losses near ln(vocab) = 4-5, gradient norms,
perplexities) are compared relatively, never with an absolute tolerance picked from one machine.
Tensors (logits, activations) are compared relatively to the tensor's own scale, with a floor of 1:
after RMSNorm the hidden states are O(1) per element, and that, not a logit's own size, is what the
rounding of the dot products that produce it scales with.
"""

from __future__ import annotations

import torch

EPS32 = torch.finfo(torch.float32).eps  # 1.19e-7

# The same fp32 forward pass in another order. Each dot product of n terms may round by up to n*eps
# of the sum of its |terms| (typically sqrt(n)*eps); the tiny test models chain a few reductions of
# length <= 128 (hidden 64, MLP 128, vocabulary 128). 1e-5 (~84 ulps) is above that drift and far
# below what any real bug moves (a wrong mask, position or weight changes logits by 1e-2 or more).
FP32_REORDERED = 1e-5

# fp32 losses and gradient norms after a few AdamW steps computed in another order (other ranks,
# another layout, resumed elsewhere): the differences above feed back through the updates and grow a
# little with each step. Measured: 2.2e-6 relative at step 6 on one CPU (4.914389 vs 4.914400), 0 on
# another; 2e-5 (~170 ulps) leaves a factor 9, and a real error (a lost gradient, a wrong shard, a
# step applied twice) moves a loss near 5 by 1e-3 or more.
FP32_TRAINED = 2e-5

# A loss computed in fp32 from bf16 activations: bf16 keeps 8 significant bits, so half an ulp is
# 2**-9 = 2e-3 relative; the loss averages many tokens' errors, 4e-3 bounds it with a factor 2.
BF16_LOSS = 4e-3


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rel: float = FP32_REORDERED) -> None:
    """Element-wise within `rel` of the larger of the expected tensor's scale and 1 (module docstring)."""
    scale = max(float(expected.detach().abs().max()) if expected.numel() else 0.0, 1.0)
    torch.testing.assert_close(actual, expected, rtol=rel, atol=rel * scale)


def assert_bf16_logits_agree(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """bf16 logits `[n, vocab]` (as float32): within 4 bf16 ulps of the expected scale (and 1), and the same top-1
    wherever the expected top two are more than 8 ulps apart (away from ties); some such row must exist."""
    eps = torch.finfo(torch.bfloat16).eps
    scale = max(float(expected.abs().max()), 1.0)
    torch.testing.assert_close(actual, expected, rtol=0, atol=4 * eps * scale)
    top2 = expected.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 8 * eps * scale
    assert clear.any()
    assert torch.equal(actual.argmax(-1)[clear], expected.argmax(-1)[clear])


__all__ = ["EPS32", "FP32_REORDERED", "FP32_TRAINED", "BF16_LOSS", "assert_close", "assert_bf16_logits_agree"]
