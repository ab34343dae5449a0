"""Microbenchmark of the CPU's ways to compute one weight-only int8 projection, on the reference's sizes.

Why this exists: the CPU backend picks, per shape and dtype, how an int8 projection runs
(`backends/cpu/formulations.py`), and each pick needs a measurement on the same projection sizes, in the
same process, alternating, with medians. The ways timed (`--ways`):

- `aten`: ATen's `_weight_int8pack_mm` with activations and scales in the case's dtype;
- `aten_bf16`: the same kernel in bfloat16 for float32 activations (cast in, cast the result back);
- `generic`: the int8 weight widened to the activations' dtype, then the GEMM, then the scales;
- `dense`: the GEMM of an unquantized weight of the case's dtype (what int8 competes with);
- `reduce_bf16`: bf16's compiled batch-1 reduction (the decode formulation of a bf16 model), compiled;
- `reduce_i8`: inductor's multiply-and-sum over the int8 rows, compiled;
- `reduce_i32`: the int8 rows viewed as int32 (four values an element) and unpacked with shifts in the
  compiled loop, so that inductor loads full-width vectors;
- `reduce_i32_split`: the same, with the activations split by byte position first, so the loop is four
  contiguous products over the int32 columns;
- `reduce_i32_blocks`: the int8 weight stored interleaved (byte i of int32 column k is column i * in/4 + k),
  so each unpacked byte position multiplies a contiguous quarter of the activations, with no copy;
- `stream`: the CPU backend's streaming kernel for a decode row (`backends/cpu/gemv.py`).

`--copies N` gives `aten`, `aten_bf16`, `stream`, `dense` and `reduce_bf16` N copies of the weight, each call
the next one, so that with N large enough (N x the weight's bytes well past the last-level cache) they read
from memory, as in a decode step, not from cache.

Each (shape, rows, dtype, threads) case times every way `--rounds` times in turn (A B C A B C ...), each
a median of `--calls` calls, and reports the medians and the ratios to `aten`. Prints JSON, with
`/proc/pressure/cpu` before and after.

    python bench/int8_kernels.py --dtypes float32 bfloat16 --rows 1 8 128 --threads 1 2
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference import pressure  # noqa: E402
from reference import report as write_report  # noqa: E402

from staticformers.backends.cpu import gemv as int8_gemv  # noqa: E402

# the reference's projections (41m): q/o, k/v, gate/up, down, and the tied head
SHAPES = {"q_o": (512, 512), "k_v": (256, 512), "gate_up": (1536, 512), "down": (512, 1536), "head": (32000, 512)}


def unpack_int32(packed: torch.Tensor) -> torch.Tensor:
    """`[out, in/4]` int32 (four int8 values an element, little-endian) back to `[out, in]` float32 values,
    with shifts: the loop reads the weight as full-width int32 vectors."""
    parts = [((packed << (24 - 8 * i)) >> 24) for i in range(4)]  # arithmetic shifts sign-extend each byte
    return torch.stack(parts, -1).reshape(packed.shape[0], -1).float()


def reduce_i32(packed, scale, x):
    return (
        ((unpack_int32(packed).unsqueeze(1) * x.reshape(1, -1, x.shape[-1]).float()).sum(-1) * scale.float())
        .t()
        .to(x.dtype)
    )


def reduce_i32_split(packed, scale, x):
    """The same unpacking, with the activations split by byte position first (`x4[i]` = `x[:, i::4]`, a small
    copy per call), so that the loop over the int32 columns is four contiguous products summed."""
    rows, k4 = x.reshape(-1, x.shape[-1]).shape[0], packed.shape[1]
    x4 = x.reshape(rows, k4, 4).float().permute(2, 0, 1)  # [4, rows, in/4]
    y = sum(((packed << (24 - 8 * i)) >> 24).float().unsqueeze(1) * x4[i].unsqueeze(0) for i in range(4)).sum(-1)
    return (y * scale.float()).t().to(x.dtype)


def interleave_int32(q: torch.Tensor) -> torch.Tensor:
    """`[out, in]` int8 stored as `[out, in/4]` int32 whose byte i of element k is column `i * in/4 + k`: the
    four unpacked values of a loop step then multiply four contiguous runs of the activations."""
    k4 = q.shape[1] // 4
    return q.reshape(q.shape[0], 4, k4).transpose(1, 2).contiguous().view(torch.int32).reshape(q.shape[0], k4)


def reduce_i32_blocks(packed, scale, x):
    """The interleaved int32 rows (`interleave_int32`) unpacked with shifts, each byte position against its
    contiguous quarter of the activations."""
    k4 = packed.shape[1]
    xr = x.reshape(-1, 4, k4).float()  # [rows, 4, in/4]: quarter i is contiguous
    y = sum(((packed << (24 - 8 * i)) >> 24).float().unsqueeze(1) * xr[:, i].unsqueeze(0) for i in range(4)).sum(-1)
    return (y * scale.float()).t().to(x.dtype)


def reduce_i8(q, scale, x):
    return ((q.float().unsqueeze(1) * x.reshape(1, -1, x.shape[-1]).float()).sum(-1) * scale.float()).t().to(x.dtype)


def reduce_dense(w, x):
    return (w.float().unsqueeze(1) * x.reshape(1, -1, x.shape[-1]).float()).sum(-1).t().to(x.dtype)


def rotating(t: torch.Tensor, copies: int):
    """A function returning, at each call, the next of `copies` copies of `t` (`t` itself first)."""
    return functools.partial(next, itertools.cycle([t] + [t.clone() for _ in range(copies - 1)]))


def ways_for(shape, rows, dtype, wanted, copies: int = 1):
    out_f, in_f = shape
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(out_f, in_f, generator=gen) * 0.05
    scale = w.abs().amax(1, keepdim=True) / 127
    q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
    dense = (q.float() * scale).to(dtype)
    x = torch.randn(rows, in_f, generator=gen).to(dtype)
    s_dt, s_bf = scale.to(dtype), scale.to(torch.bfloat16)
    dense_bf = dense.to(torch.bfloat16)
    packed = q.view(torch.int32)
    qs, denses = rotating(q, copies), rotating(dense, copies)
    ways = {
        "aten": lambda: torch._weight_int8pack_mm(x, qs(), s_dt.view(-1)),
        "aten_bf16": lambda: torch._weight_int8pack_mm(x.to(torch.bfloat16), qs(), s_bf.view(-1)).to(dtype),
        "generic": lambda: F.linear(x, q.to(dtype)) * s_dt.view(-1),
        "dense": lambda: F.linear(x, denses()),
    }
    if int8_gemv.supports(x, s_dt):
        ways["stream"] = lambda: int8_gemv.int8_gemv(x, [qs()], [s_dt.view(-1)])[0]
    if rows <= 8:
        c_bf = torch.compile(reduce_dense, fullgraph=True, dynamic=False)
        dense_bfs = rotating(dense_bf, copies)
        c_i8 = torch.compile(reduce_i8, fullgraph=True, dynamic=False)
        c_i32 = torch.compile(reduce_i32, fullgraph=True, dynamic=False)
        ways["reduce_bf16"] = lambda: c_bf(dense_bfs(), x)
        ways["reduce_i8"] = lambda: c_i8(q, s_dt, x)
        ways["reduce_i32"] = lambda: c_i32(packed, s_dt, x)
        c_i32s = torch.compile(reduce_i32_split, fullgraph=True, dynamic=False)
        ways["reduce_i32_split"] = lambda: c_i32s(packed, s_dt, x)
        c_i32b, blocks = torch.compile(reduce_i32_blocks, fullgraph=True, dynamic=False), interleave_int32(q)
        ways["reduce_i32_blocks"] = lambda: c_i32b(blocks, s_dt, x)
    if dtype == torch.bfloat16:
        ways.pop("aten_bf16")
    exact = x.float() @ dense.float().t()
    chosen = {k: v for k, v in ways.items() if k in wanted}
    errors = {k: float((fn().float() - exact).abs().max() / exact.abs().max()) for k, fn in chosen.items()}
    return chosen, errors


def time_calls(fn, calls):
    ts = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 8, 128])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument(
        "--ways",
        nargs="+",
        default=[
            "aten",
            "aten_bf16",
            "generic",
            "dense",
            "reduce_bf16",
            "reduce_i8",
            "reduce_i32",
            "reduce_i32_split",
            "reduce_i32_blocks",
            "stream",
        ],
    )
    ap.add_argument(
        "--copies", type=int, default=1, help="weight copies, one call each in turn (past the cache: from memory)"
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    report = {"torch": torch.__version__, "pressure_before": pressure(), "cases": []}
    for threads in args.threads:
        torch.set_num_threads(threads)
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            for rows in args.rows:
                for shape_name in args.shapes:
                    ways, errors = ways_for(SHAPES[shape_name], rows, dtype, args.ways, args.copies)
                    for fn in ways.values():  # warm: compile, pack, caches
                        fn(), fn()
                    times = {k: [] for k in ways}
                    for _ in range(args.rounds):
                        for k, fn in ways.items():
                            times[k].append(time_calls(fn, args.calls))
                    ms = {k: round(statistics.median(v) * 1e3, 4) for k, v in times.items()}
                    case = {
                        "threads": threads,
                        "dtype": dtype_name,
                        "rows": rows,
                        "shape": shape_name,
                        "copies": args.copies,
                        "out_in": SHAPES[shape_name],
                        "ms": ms,
                        "vs_aten": {k: round(v / ms["aten"], 3) for k, v in ms.items()} if "aten" in ms else None,
                        "max_rel_error": {k: float(f"{v:.2e}") for k, v in errors.items()},
                        "pressure_after": pressure(),
                    }
                    report["cases"].append(case)
                    print(json.dumps(case), file=sys.stderr, flush=True)
                    if args.out:
                        with open(args.out, "w") as f:
                            json.dump(report, f, indent=1)
    report["pressure_after"] = pressure()
    write_report(report, args.out)


if __name__ == "__main__":
    main()
