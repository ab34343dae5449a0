"""The CPU's tuning thresholds, in one table: defaults measured on one machine and one model, not facts.

Each was chosen by a benchmark on the 41.6M Qwen3-shaped reference model (`bench/reference.py`) on a
2-core x86 machine, recorded in BENCHMARKS.md under the section named beside it. Another CPU, another
model size or another PyTorch may move every one of them: re-measure with the named script before
relying on them (`bench/generate.py --batch 1 8 --dtype float32 bfloat16` shows the decode choices,
`bench/train.py` the attention block).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Threshold:
    value: int
    chosen_by: str  # the benchmark, and the BENCHMARKS.md section that has its figures
    meaning: str


TABLE = {
    "fast_decode_max_batch": Threshold(
        8,
        "bench/generate.py (BENCHMARKS.md, Generation)",
        "the largest batch bucket whose decode step gets the measured formulations; above it every linear is a GEMM",
    ),
    "bf16_head_reduction_max_batch": Threshold(
        2,
        "bench/generate.py (BENCHMARKS.md, Generation)",
        "up to this batch a bf16 `lm_head` is a weight-streaming reduction (float32: up to "
        "fast_decode_max_batch), where this PyTorch's bf16 GEMM reads that weight slowly",
    ),
    "attention_query_block": Threshold(
        128,
        "bench/train.py (BENCHMARKS.md, Training)",
        "the query block of causal bf16 attention (`attend_blocks`); at least two blocks of queries take it",
    ),
    "int8_kernel_max_rows": Threshold(
        16,
        "bench/int8_kernels.py and bench/generate.py --quantization int8 (BENCHMARKS.md, Weight-only int8)",
        "up to this many rows (batch x positions) an int8 projection runs an int8 kernel (one row: the streaming "
        "kernel, `int8_gemv_max_rows`; more: ATen's, in bf16 for float32 activations); past it, a prompt's, the "
        "int8 weight widened to the activations' dtype, then the GEMM, which beat the kernel from 32 rows in bf16",
    ),
    "int8_gemv_max_rows": Threshold(
        1,
        "bench/int8_kernels.py and bench/generate.py --quantization int8 (BENCHMARKS.md, Weight-only int8)",
        "up to this many rows an int8 projection runs the streaming kernel (`gemv.py`); past it, ATen's "
        "int8 kernel, which widens each weight value once for all the rows where the streaming kernel widens "
        "it again per row",
    ),
    "bf16_gemv_max_rows": Threshold(
        8,
        "bench/ab.py --model smollm2 --dtypes bfloat16 (BENCHMARKS.md, A streaming bf16 kernel)",
        "up to this many rows a bf16 decode step's projections run the streaming kernel (`gemv.py`), which "
        "reads each weight row once for all the rows; past it, oneDNN's GEMM over packed weights",
    ),
    "realize_reads_threshold": Threshold(
        2,
        "bench/generate.py (BENCHMARKS.md, Generation)",
        "inductor's `realize_reads_threshold` on the CPU: a pointwise result read by this many consumers is "
        "stored, not recomputed inside each weight-streaming reduction",
    ),
}


def threshold(name: str) -> int:
    return TABLE[name].value


__all__ = ["TABLE", "Threshold", "threshold"]
