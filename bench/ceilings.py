"""The hardware ceilings every benchmark reports utilisation against, measured in the same run on the
same device, and the clock the benchmarks time with. Shared by every script in bench/.

- **Memory bandwidth** (`MemoryCeiling`, `memory_ceiling`), what a decode step is bound by:
  - on a GPU, a device-to-device copy of a buffer the size of the weights, timed with CUDA events;
    bytes read plus bytes written per second (HBM's rate; ~4.3 TB/s measured on an H200 this way);
  - on the CPU, the best of several reads of the same bytes as the weights, a `[bytes / (cols x element
    size), cols]` matrix in the weights' dtype (81,250 x 512 for the 41.6M reference model), in huge pages as
    the library lays out a model's weights (`host_matrix`): `torch.mv`
    (what a BLAS GEMV reaches), `sum` (a plain streaming read), and an inductor-compiled multiply-and-sum
    reduction `(x.unsqueeze(-2) * w).sum(-1, dtype=torch.float32)` (one vectorised weight-streaming
    loop); over int8 rows, also the bf16 reduction over the same bytes read as bf16 pairs (a CPU without bf16
    arithmetic, AVX2, reads int8 rows widened in the loop several times slower than its memory delivers them,
    so no int8 reduction there measures the memory). No single probe is the fastest on every CPU and dtype
    (BLAS GEMVs can be far below the memory's speed), so the ceiling is the fastest rate any of them reached. A small model can sit in a
    large L3 (166 MB in 480 MiB here): the probes read the weights' bytes, not a larger buffer, so they
    measure wherever those bytes live.
  - The machine's state moves during a run (the probes have read the same bytes at rates a quarter
    apart at the start and the end of one run), so a benchmark samples the ceiling between its
    contenders' runs (`MemoryCeiling.sample`) and reports utilisation against the best of all samples.
- **Matmul FLOP/s** (`matmul_ceiling`), what training is bound by: a large bf16 matmul (8192^3 on a
  GPU, 1024^3 on the CPU), 2 n^3 FLOP per product.
- **Timing** (`Clock`, `median_seconds`): wall time with the device synchronized at both ends, so a
  GPU's queued work is counted; CUDA events for the probes' own kernels.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Optional

import torch


def as_device(device) -> torch.device:
    """A torch.device from "cpu", "cuda", "cuda:N" or a torch.device; "cuda" means cuda:0."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", 0)
    return d


def check_device(device) -> torch.device:
    """The device, or one sentence saying why it cannot be used here."""
    d = as_device(device)
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(
                f"--device {device}: this PyTorch sees no CUDA GPU (torch {torch.__version__}); "
                f"run on a machine with an NVIDIA GPU or pass --device cpu."
            )
        if d.index >= torch.cuda.device_count():
            raise SystemExit(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s).")
    elif d.type != "cpu":
        raise SystemExit(f"--device {device}: the benchmarks run on cpu, cuda or cuda:N.")
    return d


def sig(x: float, digits: int = 3) -> float:
    """`x` to `digits` significant figures (utilisation of a tiny model is far below 0.001, yet not 0)."""
    return float(f"{x:.{digits}g}")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Clock:
    """`with Clock(device) as c: ...` then `c.seconds`: wall time, the device synchronized at both ends."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds = 0.0

    def __enter__(self) -> "Clock":
        synchronize(self.device)
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        synchronize(self.device)
        self.seconds = time.perf_counter() - self._start


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int = 7, warmup: int = 2) -> float:
    """Median seconds of `fn()`: CUDA events around each call on a GPU, a synchronized clock elsewhere."""
    if device.type == "cuda":
        with torch.cuda.device(device):  # the events record on this device's current stream
            return _median_cuda_seconds(fn, repeats, warmup)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        with Clock(device) as c:
            fn()
        times.append(c.seconds)
    return statistics.median(times)


def _median_cuda_seconds(fn: Callable[[], object], repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def _multiply_and_sum(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`w @ x` written as a reduction, which inductor turns into one loop streaming `w` once."""
    return (x.unsqueeze(-2) * w).sum(-1, dtype=torch.float32)


def _multiply_and_sum_int8(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The same over int8 rows, widened to bf16 inside the loop (what an int8 decode step reads)."""
    return (x.unsqueeze(-2) * w.to(torch.bfloat16)).sum(-1, dtype=torch.float32)


def host_matrix(rows: int, cols: int, fill: torch.Tensor) -> torch.Tensor:
    """A `[rows, cols]` CPU matrix holding `fill`, in one block of huge pages where the library can make one (as
    the CPU lays out a model's weights, `backends/cpu/weight_arena.py`), so that the probes read memory as the
    decode step does; a plain tensor otherwise."""
    try:
        from staticformers.backends.cpu.weight_arena import huge_page_block
    except ImportError:  # a peer's environment without the library
        return fill.clone()
    _, block, _ = huge_page_block(rows * cols * fill.element_size())
    out = block.view(fill.dtype).view(rows, cols)
    out.copy_(fill)
    return out


class MemoryCeiling:
    """The memory bandwidth a decode step over `nbytes` of weights can reach on `device` (module docstring),
    sampled as often as the caller likes: `sample()` between the contenders' runs, `result()` the best rate
    any probe reached over every sample so far."""

    def __init__(
        self,
        device: torch.device,
        nbytes: int,
        dtype: torch.dtype = torch.bfloat16,
        cols: int = 512,
        backend: str = "inductor",
    ):
        """`backend` compiles the CPU's multiply-and-sum probe (another than inductor: a quick dry run, which
        does not judge the ceiling, skips inductor's C++ compile)."""
        self.device = device
        nbytes = max(int(nbytes), 1 << 20)
        if device.type == "cuda":  # the buffers are made per sample: between samples they hold no GPU memory

            def copy():
                src = torch.empty(nbytes, dtype=torch.uint8, device=device)
                dst = torch.empty_like(src)
                return lambda: dst.copy_(src)

            self._make = lambda: {"copy": copy()}
            self.bytes = 2 * nbytes
            self.what = f"device-to-device copy of {nbytes / 1e9:.3f} GB (bytes read + written)"
        elif dtype == torch.int8:  # int8 weights (bench/generate.py --quantization): no int8 GEMV in torch
            if cols % 2:
                raise ValueError(f"the int8 probe reads its bytes as bf16 pairs too: give an even cols, not {cols}.")
            rows = max(nbytes // cols, 1)
            fill = torch.randint(-127, 128, (rows, cols), dtype=torch.int8)
            fill[fill == 0] = 1  # no byte pair read as bf16 below is a zero or a subnormal
            w = host_matrix(rows, cols, fill)
            x = torch.randn(cols).to(torch.bfloat16)
            reduction = torch.compile(_multiply_and_sum_int8, backend=backend, fullgraph=True, dynamic=False)
            as_bf16 = torch.compile(_multiply_and_sum, backend=backend, fullgraph=True, dynamic=False)
            pairs, x_pairs = w.view(torch.bfloat16), torch.randn(cols // 2).to(torch.bfloat16)
            probes = {
                "sum": lambda: w.sum(dtype=torch.int32),
                "compiled multiply-and-sum": lambda: reduction(x, w),
                "compiled multiply-and-sum over the bytes as bf16": lambda: as_bf16(x_pairs, pairs),
            }
            self._make = lambda: probes
            self.bytes = rows * cols
            self.what = (
                f"the best of sum, a compiled multiply-and-sum (bf16 x, int8 rows widened in the loop) and the bf16 "
                f"probe reading the same bytes as bf16 pairs, over a {rows} x {cols} int8 matrix "
                f"({self.bytes / 1e6:.1f} MB)"
            )
        else:
            size = torch.tensor([], dtype=dtype).element_size()
            rows = max(nbytes // (cols * size), 1)
            w = host_matrix(rows, cols, torch.randn(rows, cols).to(dtype))
            x = torch.randn(cols).to(dtype)
            reduction = torch.compile(_multiply_and_sum, backend=backend, fullgraph=True, dynamic=False)
            probes = {
                "torch.mv": lambda: torch.mv(w, x),
                "sum": lambda: w.sum(dtype=torch.float32),
                "compiled multiply-and-sum": lambda: reduction(x, w),
            }
            self._make = lambda: probes
            self.bytes = rows * cols * size
            self.what = (
                f"the best of torch.mv, sum and a compiled multiply-and-sum over a {rows} x {cols} "
                f"{str(dtype).replace('torch.', '')} matrix ({self.bytes / 1e6:.1f} MB)"
            )
        self.seconds: dict[str, float] = {}  # the fastest time of each probe so far
        self.samples: list[dict] = []  # GB/s of each probe, one dict per sample

    def sample(self, repeats: int = 7) -> dict:
        """Time every probe once more (a median of `repeats` calls each); their GB/s in this sample."""
        rates = {}
        probes = self._make()
        for name, fn in probes.items():
            seconds = median_seconds(fn, self.device, repeats)
            self.seconds[name] = min(self.seconds.get(name, seconds), seconds)
            rates[name] = sig(self.bytes / seconds / 1e9)
        del probes
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.samples.append(rates)
        return rates

    def result(self) -> dict:
        """The best rate so far (`gb_s`), which probe reached it, and every sample (sampling once if none was)."""
        if not self.samples:
            self.sample()
        best = min(self.seconds, key=self.seconds.get)
        seconds = self.seconds[best]
        return {
            "what": self.what,
            "bytes": self.bytes,
            "seconds": seconds,
            "gb_s": sig(self.bytes / seconds / 1e9),
            "probe": best,
            "samples": list(self.samples),
        }

    def close(self) -> None:
        """Free the probes' CPU matrix (the weights' size); `result()` still answers, `sample()` no longer."""

        def closed():
            raise RuntimeError("this MemoryCeiling was closed: make a new one to sample again.")

        self._make = closed


def memory_ceiling(
    device: torch.device, nbytes: int, dtype: torch.dtype = torch.bfloat16, cols: int = 512, repeats: int = 7
) -> dict:
    """One sample of `MemoryCeiling(device, nbytes, dtype, cols)`: its `result()`."""
    ceiling = MemoryCeiling(device, nbytes, dtype, cols)
    ceiling.sample(repeats)
    out = ceiling.result()
    ceiling.close()
    return out


def matmul_ceiling(
    device: torch.device, n: Optional[int] = None, dtype: torch.dtype = torch.bfloat16, repeats: int = 10
) -> dict:
    """FLOP/s of an n x n x n matmul in `dtype` (n: 8192 on a GPU, 1024 on the CPU)."""
    n = n or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    seconds = median_seconds(lambda: a @ b, device, repeats, warmup=3)
    flop = 2 * n**3
    return {
        "what": f"{n}^3 {str(dtype).replace('torch.', '')} matmul",
        "flop": flop,
        "seconds": seconds,
        "tflop_s": sig(flop / seconds / 1e12),
    }


def device_info(device: torch.device) -> dict:
    """What the figures were measured on."""
    import os
    import platform

    info = {"device": str(device), "torch": torch.__version__, "python": platform.python_version()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            name=props.name,
            memory_gb=round(props.total_memory / 1e9, 1),
            multiprocessors=props.multi_processor_count,
            cuda=torch.version.cuda,
        )
    else:
        info.update(
            name=platform.processor() or platform.machine(), threads=torch.get_num_threads(), cpus=os.cpu_count()
        )
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    return info


def peak_memory_gb(device: torch.device) -> Optional[float]:
    """Peak memory allocated by PyTorch on a GPU since the last reset (None on the CPU)."""
    if device.type != "cuda":
        return None
    return round(torch.cuda.max_memory_allocated(device) / 1e9, 3)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
