"""gemv.py: the CPU's streaming kernels for a decode step's rows against the exact product. int8: every pairing of
activation and scale dtypes, grouped calls, the rows' tail past the vector width, the formulation that picks it
(one row: the kernel; more: ATen's), q/k/v and gate/up as one call, a traced graph calling it whole, the
fallback where it cannot be built, and bad input refused in one sentence; the threads' split (shares, tails
taken by others) against one thread. bf16: 1-8 rows and more (blocks of 8),
on AMX's tiles and on the vector loop (`STATICFORMERS_AMX=0`), grouped calls, the `"stream"` formulation (LoRA bases stream, hooked and float32 layers reduce), the fallback."""

from __future__ import annotations

import pytest
import torch

from staticformers.backends.cpu import formulations as f
from staticformers.backends.cpu import gemv as g
from staticformers.models.quantization import QuantLinear

pytestmark = pytest.mark.usefixtures("one_thread", "kernel")


@pytest.fixture(scope="module")
def kernel():
    """Built (or read from inductor's cache) when a test of this file runs, not when it is collected."""
    if not g.loaded():
        pytest.skip("the streaming kernels cannot be built here (no C++ compiler, or no AVX2/AVX-512 for inductor)")


def count_calls(monkeypatch, name: str) -> list:
    """The formulations' calls of kernel `name` from now on, each as its number of weights."""
    calls: list = []
    real = getattr(f, name)

    def counting(x, weights, *rest):
        calls.append(len(weights))
        return real(x, weights, *rest)

    monkeypatch.setattr(f, name, counting)
    return calls


def exact(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The product in float64 from the same inputs, and the sum of its terms' magnitudes (for the bound)."""
    xd, wd, sd = x.double(), w.double(), s.double()
    return (xd @ wd.t()) * sd, (xd.abs() @ wd.abs().t()) * sd.abs()


def check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> None:
    """float32 sums of K terms: within K * 2**-24 of the magnitudes (any order), plus the output's rounding
    to its dtype (bf16: half a unit in the last place, 2**-8 relative)."""
    want, mags = exact(x, w, s)
    k = x.shape[-1]
    bound = k * 2**-24 * mags + (2**-8 * want.abs() if y.dtype == torch.bfloat16 else 0) + 1e-30
    err = (y.double() - want).abs()
    assert (err <= bound).all(), float((err / bound).max())


@pytest.mark.parametrize("act", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scale", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [512, 100])  # a whole number of vector iterations, and a scalar tail
def test_the_kernel_is_the_exact_product_for_each_dtype_pairing(act, scale, k):
    torch.manual_seed(0)
    ws = [torch.randint(-127, 128, (n, k), dtype=torch.int8) for n in (40, 24, 24)]
    ss = [(torch.rand(w.shape[0]) * 0.02 + 1e-3).to(scale) for w in ws]
    for rows in (1, 3):
        x = torch.randn(rows, k).to(act)
        assert g.supports(x, *ss)
        ys = g.int8_gemv(x, ws, ss)
        assert [y.shape for y in ys] == [(rows, w.shape[0]) for w in ws] and all(y.dtype == act for y in ys)
        for y, w, s in zip(ys, ws, ss):
            check(y, x, w, s)


def test_a_non_contiguous_input_is_read_as_its_values():
    torch.manual_seed(1)
    w = torch.randint(-127, 128, (32, 64), dtype=torch.int8)
    s = torch.rand(32) * 0.01
    x = torch.randn(64, 2).t()  # [2, 64], transposed
    check(g.int8_gemv(x, [w], [s])[0], x, w, s)
    check(g.int8_gemv(x, [w.t().contiguous().t()], [s])[0], x, w, s)


def test_the_threads_split_the_rows_of_a_group_and_sum_them_as_one_thread_does():
    """Past the size that wakes the other threads, each thread takes a range of the group's rows (one starting
    inside the second weight): the sums are the one-thread sums, bit for bit."""
    torch.manual_seed(2)
    ws = [torch.randint(-127, 128, (n, 256), dtype=torch.int8) for n in (300, 200)]
    ss = [torch.rand(w.shape[0]) * 0.01 for w in ws]
    x = torch.randn(2, 256)
    alone = g.int8_gemv(x, ws, ss)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        split = g.int8_gemv(x, ws, ss)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(alone, split):
        assert torch.equal(a, b)


@pytest.mark.parametrize("threads", [2, 3, 5])
@pytest.mark.parametrize("rows", [(9,), (40, 7), (300, 200)])
def test_every_row_is_computed_once_however_the_threads_share_and_take_the_tails(threads, rows, monkeypatch):
    """The threads own contiguous shares and take each other's tails once done (`split_rows`): shares smaller
    than their tail, a weight of fewer rows than the threads, any thread count, give the one-thread sums, int8
    and bf16, bit for bit (a row missed would be an uninitialised output, a row done twice the same value)."""
    monkeypatch.setenv("STATICFORMERS_AMX", "0")  # AMX's tiles split their own way; this is the vector loops' split
    torch.manual_seed(5)
    k = 8192  # enough values that even 9 rows wake the other threads
    ws8 = [torch.randint(-127, 128, (n, k), dtype=torch.int8) for n in rows]
    ss = [torch.rand(n) * 0.01 for n in rows]
    ws16 = [torch.randn(n, k).bfloat16() for n in rows]
    x = torch.randn(3, k)
    alone = (g.int8_gemv(x, ws8, ss), g.bf16_gemv(x.bfloat16(), ws16))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kept = []  # every call's outputs stay alive, so no call writes into buffers that already hold the sums
        for _ in range(3):  # which thread takes which tail changes from call to call
            split = (g.int8_gemv(x, ws8, ss), g.bf16_gemv(x.bfloat16(), ws16))
            kept.append(split)
            for a, b in zip(alone[0] + alone[1], split[0] + split[1]):
                assert torch.equal(a, b)
    finally:
        torch.set_num_threads(before)


def test_one_decode_row_runs_the_kernel_and_a_few_rows_atens():
    """A float32 layer's one row through the kernel is float32-exact; a few rows run ATen's kernel in bf16,
    within bf16's rounding of the activations, scales and result (3 * 2**-9 of the terms' magnitudes)."""
    torch.manual_seed(0)
    layer = QuantLinear.from_linear(torch.nn.Linear(64, 48, bias=True), "int8")
    one, few = torch.randn(1, 1, 64), torch.randn(2, 1, 64)
    with torch.no_grad():
        assert f.streams(layer, one) and not f.streams(layer, few)
        assert f.int8_kernel(layer, one) and f.int8_kernel(layer, few)
        for how in (None, "reduce", "onednn"):
            got = f.project(layer, one, how)
            want = layer(one)
            _, mags = exact(one.reshape(1, 64), layer.weight, layer.weight_scale.view(-1))
            assert ((got - want).abs().reshape(1, -1) <= 64 * 2**-24 * mags.float() + 1e-6).all()
        got, want = f.project(layer, few), layer(few)
        _, mags = exact(few.reshape(2, 64), layer.weight, layer.weight_scale.view(-1))
        err = (got - want).abs().reshape(2, -1)
        assert (err <= 3 * 2**-9 * mags.float() + 1e-5).all() and float(err.max()) > 1e-6  # bf16 did round


def test_q_k_v_and_gate_up_are_one_call_and_mixed_groups_are_not(monkeypatch):
    torch.manual_seed(0)
    layers = tuple(
        QuantLinear.from_linear(torch.nn.Linear(64, n, bias=b).bfloat16(), "int8")
        for n, b in ((64, True), (32, False), (32, False))
    )
    calls = count_calls(monkeypatch, "int8_gemv")
    ops = f.CPUOps("reduce", "reduce", "reduce")
    x = torch.randn(1, 1, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        together = ops.linear_group(layers, x)
        assert calls == [3]
        alone = [ops.linear(layer, x) for layer in layers]
        assert calls == [3, 1, 1, 1]
        for a, b in zip(together, alone):
            torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same sums, in the same order
        plain = torch.nn.Linear(64, 16).bfloat16()
        mixed = ops.linear_group((layers[0], plain), x)
        assert calls == [3, 1, 1, 1, 1]  # the int8 one alone; the plain one as a reduction
        torch.testing.assert_close(mixed[1], plain(x), rtol=2**-7, atol=1e-3)


def test_a_traced_graph_calls_the_kernel_whole():
    layer = QuantLinear.from_linear(torch.nn.Linear(64, 48), "int8")
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    x = torch.randn(1, 1, 64)
    with torch.no_grad():
        traced = torch.compile(lambda x: f.project(layer, x, "reduce"), backend=backend, fullgraph=True)
        torch.testing.assert_close(traced(x), f.project(layer, x, "reduce"), rtol=0, atol=0)
    assert any("int8_gemv" in t for t in seen), seen


def test_where_the_kernel_cannot_run_atens_does(monkeypatch):
    monkeypatch.setitem(g._STATE, "loaded", False)
    torch.manual_seed(0)
    layer = QuantLinear.from_linear(torch.nn.Linear(64, 48), "int8").bfloat16()
    x = torch.randn(1, 1, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        assert not f.streams(layer, x) and f.int8_kernel(layer, x)
        got = f.project(layer, x, "reduce").reshape(1, -1).double()
        want, mags = exact(x.reshape(1, -1), layer.weight, layer.weight_scale.view(-1))
        want = want + layer.bias.double()
        assert ((got - want).abs() <= 3 * 2**-8 * (mags + layer.bias.double().abs())).all()  # bf16 roundings


def test_bad_input_is_refused_in_one_sentence():
    w = torch.zeros(8, 64, dtype=torch.int8)
    with pytest.raises(RuntimeError, match=r"weight 0 must be int8 \[out, 32\]"):
        g.int8_gemv(torch.randn(1, 32), [w], [torch.ones(8)])
    with pytest.raises(RuntimeError, match=r"scale 1 must be Float \[8\]"):
        g.int8_gemv(torch.randn(1, 64), [w, w], [torch.ones(8), torch.ones(4)])
    with pytest.raises(RuntimeError, match="x must be bfloat16 or float32"):
        g.int8_gemv(torch.randn(1, 64).half(), [w], [torch.ones(8)])


def test_a_fresh_process_calling_the_operator_first_loads_its_kernel():
    """A graph saved by another process calls the operator before anything asked `supports`: the fallback
    kernel loads the C++ one, which then takes the calls."""
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from staticformers.backends.cpu import gemv as g\n"
        "assert 'loaded' not in g._STATE\n"
        "torch.manual_seed(0)\n"
        "w = torch.randint(-127, 128, (8, 64), dtype=torch.int8); x = torch.randn(1, 64); s = torch.rand(8)\n"
        "y = torch.ops.staticformers.int8_gemv(x, [w], [s])[0]\n"
        "assert g._STATE['loaded']\n"
        # float32 sums of 64 products: each output within 64 roundings of the sum of the products' sizes
        "bound = 64 * torch.finfo(torch.float32).eps * (x.double().abs() @ w.double().abs().t() * s.double())\n"
        "assert ((y.double() - x.double() @ w.double().t() * s.double()).abs() <= bound).all()\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


# ---- bfloat16 ------------------------------------------------------------------------------------------------


def check_bf16(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """float32 sums of K exact products of bf16 values (8-bit significands: each product fits float32), then one
    rounding to bf16: within K * 2**-24 of the magnitudes plus half a bf16 unit (2**-8 relative)."""
    xd, wd = x.double(), w.double()
    want, mags = xd @ wd.t(), xd.abs() @ wd.abs().t()
    err = (y.double() - want).abs()
    bound = x.shape[-1] * 2**-24 * mags + 2**-8 * want.abs() + 1e-30
    assert (err <= bound).all(), float((err / bound).max())


@pytest.fixture(params=["amx", "dot", "vector"])
def bf16_path(request, monkeypatch):
    """The bf16 kernel's three paths: AMX's tiles (where this CPU and Linux have them), AVX512_BF16's dot products
    (where the CPU has them), and the widening vector loop."""
    monkeypatch.delenv("STATICFORMERS_BF16_DOT", raising=False)
    if request.param == "amx":
        monkeypatch.delenv("STATICFORMERS_AMX", raising=False)
        if not g.amx():
            pytest.skip("no AMX tiles on this CPU (or Linux did not grant them)")
    elif request.param == "dot":
        monkeypatch.setenv("STATICFORMERS_AMX", "0")
        if not g.dot():
            pytest.skip("no AVX512_BF16 on this CPU")
    else:
        monkeypatch.setenv("STATICFORMERS_AMX", "0")
        monkeypatch.setenv("STATICFORMERS_BF16_DOT", "0")
        assert not g.amx() and not g.dot()
    return request.param


@pytest.mark.parametrize("k", [576, 64, 100, 40])  # whole vector iterations and tiles; a tail; shorter than one
def test_the_bf16_kernel_is_the_product_rounded_once_for_1_to_19_rows(k, bf16_path):
    """Weights of 40 and 24 rows: AMX's last tiles of a weight overlap the rows before them; 17 and 19 rows: two
    tiles of activations (AMX), or blocks of 8 and a rest (the vector loop)."""
    torch.manual_seed(3)
    ws = [torch.randn(n, k).bfloat16() for n in (40, 24, 24, 16)]
    for rows in (1, 2, 3, 5, 8, 16, 17, 19):
        x = torch.randn(rows, k).bfloat16()
        assert g.bf16_supports(x)
        ys = g.bf16_gemv(x, ws)
        assert [y.shape for y in ys] == [(rows, w.shape[0]) for w in ws] and all(y.dtype == torch.bfloat16 for y in ys)
        for y, w in zip(ys, ws):
            check_bf16(y, x, w)


def test_the_bf16_kernel_gives_each_row_the_sums_it_gets_alone(bf16_path):
    """A row's sums do not depend on the other rows of its call (past a tile of 16 rows too), nor on the threads'
    split: bit for bit."""
    torch.manual_seed(4)
    ws = [torch.randn(n, 256).bfloat16() for n in (300, 200)]
    x = torch.randn(20, 256).bfloat16()
    together = g.bf16_gemv(x, ws)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        split = g.bf16_gemv(x, ws)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(together, split):
        assert torch.equal(a, b)
    for row in (4, 18):
        alone = g.bf16_gemv(x[row : row + 1], ws)
        for a, b in zip(together, alone):
            assert torch.equal(a[row : row + 1], b)


@pytest.mark.parametrize("switch, on", [("STATICFORMERS_AMX", g.amx), ("STATICFORMERS_BF16_DOT", g.dot)])
def test_the_bf16_paths_switches_are_read_at_each_call(switch, on, monkeypatch):
    """`STATICFORMERS_AMX=0` (AMX's tiles) and `STATICFORMERS_BF16_DOT=0` (AVX512_BF16's dot products, where AMX
    does not run) turn their path off from the next call on, and each loop gives the product rounded once."""
    monkeypatch.delenv("STATICFORMERS_BF16_DOT", raising=False)
    monkeypatch.setenv("STATICFORMERS_AMX", "1" if on is g.amx else "0")
    if not on():
        pytest.skip(f"this CPU (or Linux) gives no path for {switch} to turn off")
    torch.manual_seed(7)
    w, x = torch.randn(64, 160).bfloat16(), torch.randn(5, 160).bfloat16()
    monkeypatch.setenv(switch, "0")
    assert not on()
    check_bf16(g.bf16_gemv(x, [w])[0], x, w)
    monkeypatch.setenv(switch, "1")
    assert on()
    check_bf16(g.bf16_gemv(x, [w])[0], x, w)


def test_stream_projections_run_the_bf16_kernel_in_one_call_per_group(monkeypatch):
    """With `"stream"` linears, q/k/v (with a bias) are one call and agree with the module within bf16's rounding;
    a LoRA layer's base streams and its adapter is added; float32, int8 and hooked layers and a wanted gradient
    reduce instead; more than `BF16_GEMV_MAX_ROWS` rows run the GEMM."""
    from staticformers.adapters.lora import LoraLinear

    torch.manual_seed(5)
    layers = tuple(torch.nn.Linear(64, n, bias=b).bfloat16() for n, b in ((64, True), (32, False), (32, False)))
    calls = count_calls(monkeypatch, "bf16_gemv")
    ops = f.CPUOps("reduce", "stream", "stream")
    x = torch.randn(2, 1, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        together = ops.linear_group(layers, x)
        assert calls == [3]
        for layer, y in zip(layers, together):
            torch.testing.assert_close(y, layer(x), rtol=2**-7, atol=1e-2)
        assert torch.equal(ops.linear(layers[1], x), together[1])
        assert calls == [3, 1]
        lora = LoraLinear(torch.nn.Linear(64, 32, bias=False).bfloat16())
        lora.add("a", 4, 8, 2.0, 0.0, "gaussian", torch.bfloat16, torch.device("cpu"))
        torch.nn.init.normal_(lora.lora_B["a"].weight)
        lora.active = ("a",)
        torch.testing.assert_close(ops.linear(lora, x), lora(x), rtol=2**-6, atol=5e-2)
        assert calls == [3, 1, 1]
        hooked = torch.nn.Linear(64, 16).bfloat16()
        hooked.register_forward_hook(lambda m, i, o: o)
        for layer, h in ((torch.nn.Linear(64, 16), x.float()), (hooked, x)):
            ops.linear(layer, h)
        too_many = torch.randn(f.BF16_GEMV_MAX_ROWS + 1, 1, 64, dtype=torch.bfloat16)
        torch.testing.assert_close(ops.linear(layers[0], too_many), layers[0](too_many), rtol=2**-7, atol=1e-2)
    with torch.enable_grad():
        ops.linear(layers[0], x.clone().requires_grad_())
    assert calls == [3, 1, 1]


def test_where_the_kernel_cannot_run_stream_projections_reduce(monkeypatch):
    monkeypatch.setitem(g._STATE, "loaded", False)
    torch.manual_seed(6)
    layer = torch.nn.Linear(64, 48).bfloat16()
    x = torch.randn(1, 1, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        assert not f.bf16_streams((layer,), x)
        torch.testing.assert_close(f.project(layer, x, "stream"), f.project(layer, x, "reduce"), rtol=0, atol=0)


def test_bad_bf16_input_is_refused_in_one_sentence():
    w = torch.zeros(8, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"weight 0 must be bfloat16 \[out, 32\]"):
        g.bf16_gemv(torch.randn(1, 32).bfloat16(), [w])
    with pytest.raises(RuntimeError, match="x must be bfloat16"):
        g.bf16_gemv(torch.randn(1, 64), [w])
