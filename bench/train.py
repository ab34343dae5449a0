"""Training throughput: staticformers' Trainer against transformers.Trainer, same model, same rows, same device.

    .venv/bin/python bench/train.py [--steps 5] [--rounds 2] [--precisions fp32,bf16] [--modes eager,compiled]
    python bench/train.py --device cuda --precisions bf16 --modes compiled --rounds 1

A reference checkpoint (bench/reference.py: `--size 41m`, the default, Qwen3-shaped, 41.6M parameters;
`1.7b`; `tiny`) is loaded by both libraries. Documents have realistic lengths (log-normal, median about
180 tokens, 8 to 2,000) and random token ids; both trainers get the same padded rows `[--batch 8,
--seq 256]` (ours builds them; the peer gets them as `input_ids`/`attention_mask`/`labels` tensors),
AdamW, lr 1e-4, on `--device` (cpu: 2 threads; cuda:N: the children see only that GPU). Step ends are
timed with the device synchronized. Utilisation: model FLOP/s (6 x linear weights + 12 x layers x
heads x head_dim x seq per token, PaLM's count) over a bf16 matmul's FLOP/s measured in the same run on
the same device (bench/ceilings.py). transformers' Trainer needs `accelerate` (the `bench` extra):
without it the peer's runs are recorded as errors.

For each precision (fp32; bf16 = our bf16-weights + fp32-master recipe vs the peer's autocast) and
mode (eager; compiled = ours `torch_compile=True` with inductor vs the peer's `torch_compile=True`),
the two run interleaved A B A B (`--rounds`), each in a fresh process (so neither inherits the other's
allocator state or imports) with a fresh model and trainer for `--steps` steps.
Reported: first-step seconds (round 1, cold compile caches for both: a fresh TORCHINDUCTOR_CACHE_DIR),
steady tokens/s (median period between step ends after the first step, all rounds; tokens = the
8 x 256 positions of a step, the same for both), graphs compiled, and the ratios. Also: padding waste
of these documents padded vs packed, and ours packed (real tokens/s). `/proc/pressure/cpu` is read
before and after every run. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "src"))

BATCH, SEQ, LR = 8, 256, 1e-4


def documents(n: int, seed: int = 0, vocab: int = 32000) -> list:
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(mean=np.log(180), sigma=0.9, size=n), 8, 2000).astype(int)
    return [{"input_ids": rng.integers(3, vocab, size=int(k)).tolist()} for k in lengths]


def _sync(device: str) -> None:
    """Wait for the GPU's queued work, so that a step's end is when it finished, not when it was queued."""
    if device != "cpu":
        import torch

        torch.cuda.synchronize()


def run_ours(
    path: str,
    docs: list,
    precision: str,
    mode: str,
    steps: int,
    packing: bool = False,
    *,
    device: str = "cpu",
    batch: int = BATCH,
    seq: int = SEQ,
    backend: str | None = None,
) -> dict:

    from staticformers import AutoModelForCausalLM, Trainer, TrainingArguments

    ends = []

    class Timed(Trainer):
        def clip_gradients(self):
            norm = super().clip_gradients()
            _sync(device)
            ends.append(time.perf_counter())
            return norm

    model = AutoModelForCausalLM.from_pretrained(path)
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=batch,
        max_length=seq,
        max_steps=steps,
        learning_rate=LR,
        bf16=precision == "bf16",
        torch_compile=mode == "compiled",
        torch_compile_backend=backend,
        save_strategy="no",
        logging_steps=10**6,
        disable_tqdm=True,
        packing=packing,
        long_documents="truncate",
        use_cpu=device == "cpu",
    )
    trainer = Timed(model=model, args=args, train_dataset=docs)
    trainer.get_train_rows()  # rows are built before the clock starts, as the peer's are
    start = time.perf_counter()
    out = trainer.train()
    periods = [b - a for a, b in zip(ends, ends[1:])]
    rows = trainer.get_train_rows()
    return {
        "first_step_s": ends[0] - start,
        "step_s": periods,
        "graphs": trainer.compile_stats()["train_graphs"],
        "loss": out.training_loss,
        "padding_waste": rows.padding_waste,
        "real_tokens_per_row": rows.real_tokens / rows.num_rows,
    }


def run_theirs(
    path: str,
    rows,
    precision: str,
    mode: str,
    steps: int,
    *,
    device: str = "cpu",
    batch: int = BATCH,
    backend: str | None = None,
) -> dict:
    import transformers

    try:
        import accelerate  # noqa: F401
    except ImportError:
        raise SystemExit(
            "transformers' Trainer needs accelerate: install the bench extra (pip install -e '.[bench]')."
        ) from None
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    extra = {"torch_compile_backend": backend} if backend and mode == "compiled" else {}
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=batch,
        max_steps=steps,
        learning_rate=LR,
        bf16=precision == "bf16",
        torch_compile=mode == "compiled",
        save_strategy="no",
        logging_steps=10**6,
        report_to="none",
        use_cpu=device == "cpu",
        dataloader_drop_last=True,
        disable_tqdm=True,
        **extra,
    )
    return train_with_transformers(model, args, rows, device)


def train_with_transformers(model, args, rows, device: str) -> dict:
    """transformers' Trainer on `rows` (padded rows, -100 labels on padding), timed at every step end:
    first-step seconds (from `on_train_begin`), the periods between step ends, Dynamo graphs, the loss."""
    import torch
    import torch._dynamo.utils as dyn_utils
    import transformers

    ends, begin = [], []

    class Clock(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            _sync(device)
            begin.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            _sync(device)
            ends.append(time.perf_counter())

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return rows.num_rows

        def __getitem__(self, i):
            labels = rows.labels[i]
            return {"input_ids": rows.input_ids[i], "attention_mask": (labels != -100).long(), "labels": labels}

    before = dyn_utils.counters["stats"]["unique_graphs"]
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Rows(), callbacks=[Clock()])
    out = trainer.train()
    periods = [b - a for a, b in zip(ends, ends[1:])]
    return {
        "first_step_s": ends[0] - begin[0],
        "step_s": periods,
        "graphs": dyn_utils.counters["stats"]["unique_graphs"] - before,
        "loss": out.training_loss,
    }


def run_child(spec: dict) -> dict:
    """One contender's run in a fresh process (`--_run SPEC`): prints its JSON result, returns it."""
    env = {**os.environ, "PYTHONPATH": os.path.join(HERE, "..", "src")}
    if spec["device"].startswith("cuda:"):  # the child sees that GPU alone, as cuda:0
        env["CUDA_VISIBLE_DEVICES"] = spec["device"].split(":", 1)[1]
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--_run", json.dumps(spec)], capture_output=True, text=True, env=env
    )
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1][:500]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def child(spec: dict) -> int:
    import torch

    device = "cpu" if spec["device"] == "cpu" else "cuda"
    if device == "cpu":
        torch.set_num_threads(2)
    from reference import reference_dir
    from staticformers.training.data import build_rows

    path = reference_dir(spec["size"])  # built by the parent
    with open(os.path.join(path, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    docs = documents(spec["documents"], vocab=vocab)
    kw = dict(device=device, batch=spec["batch"], backend=spec.get("backend"))
    if spec["who"] == "ours":
        res = run_ours(
            path,
            docs,
            spec["precision"],
            spec["mode"],
            spec["steps"],
            packing=spec.get("packing", False),
            seq=spec["seq"],
            **kw,
        )
    else:
        padded = build_rows(docs, None, spec["seq"], packing=False, long_documents="truncate")
        res = run_theirs(path, padded, spec["precision"], spec["mode"], spec["steps"], **kw)
    print(json.dumps(res))
    return 0


def flops_per_token(size: str, seq: int) -> int:
    """Training FLOPs per token (forward + backward): 6 x linear weights + 12 x layers x heads x head_dim x seq."""
    from reference import SIZES, weight_counts

    c = SIZES[size]
    return (
        6 * weight_counts(size)["linear_parameters"]
        + 12 * c["num_hidden_layers"] * c["num_attention_heads"] * c["head_dim"] * seq
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "--_run":
        return child(json.loads(argv[1]))
    from reference import SIZES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N: both trainers run there")
    parser.add_argument(
        "--size", default="41m", choices=sorted(SIZES), help="reference checkpoint (bench/reference.py)"
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--documents", type=int, default=400)
    parser.add_argument("--batch", type=int, default=BATCH, help="rows per step")
    parser.add_argument("--seq", type=int, default=SEQ, help="tokens per row")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--modes", default="eager,compiled")
    parser.add_argument("--backend", default=None, help="compile backend of both (default: the device's, inductor)")
    parser.add_argument("--no-packed", action="store_true", help="skip the packed run of ours")
    parser.add_argument(
        "--matmul-n",
        type=int,
        default=None,
        help="the matmul ceiling's n (an n x n x n matmul; default 8192 on a GPU, 1024 on the CPU)",
    )
    parser.add_argument("--out", default=None, help="also write the JSON here")
    a = parser.parse_args(argv)

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-train-inductor-")  # cold for both
    import torch

    from ceilings import check_device, device_info, matmul_ceiling, sig

    device = check_device(a.device)
    if device.type == "cpu":
        torch.set_num_threads(2)
    from reference import build_reference, pressure
    from staticformers.training.data import build_rows

    build_reference(size=a.size, device=str(device))  # built once here, before the children read it
    batch, seq = a.batch, a.seq
    docs = documents(a.documents, vocab=SIZES[a.size]["vocab_size"])
    padded = build_rows(docs, None, seq, packing=False, long_documents="truncate")
    packed_bfd = build_rows(docs, None, seq, packing=True, packing_strategy="bfd")
    packed_wrapped = build_rows(docs, None, seq, packing=True, packing_strategy="wrapped")
    ceiling = matmul_ceiling(device, a.matmul_n)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    flops = flops_per_token(a.size, seq)
    report = {
        "model": f"reference Qwen3-shaped {a.size} (bench/reference.py)",
        "size": a.size,
        "batch": batch,
        "seq": seq,
        "device": device_info(device),
        "backend": a.backend or "inductor",
        "ceiling": ceiling,
        "model_flops_per_token": flops,
        "data": {
            "documents": len(docs),
            "median_tokens": statistics.median(len(d["input_ids"]) for d in docs),
            "padding_waste_padded": round(padded.padding_waste, 4),
            "padding_waste_packed_bfd": round(packed_bfd.padding_waste, 4),
            "padding_waste_packed_wrapped": round(packed_wrapped.padding_waste, 4),
            "rows_padded": padded.num_rows,
            "rows_packed_bfd": packed_bfd.num_rows,
        },
        "pressure_start": pressure(),
        "results": {},
    }
    base = {
        "steps": a.steps,
        "documents": a.documents,
        "device": str(device),
        "size": a.size,
        "batch": batch,
        "seq": seq,
        "backend": a.backend,
    }
    for precision in a.precisions.split(","):
        for mode in a.modes.split(","):
            key = f"{precision}-{mode}"
            runs = {"ours": [], "transformers": []}
            for r in range(a.rounds):
                for who in ("ours", "transformers"):
                    p0 = pressure()
                    res = run_child({**base, "who": who, "precision": precision, "mode": mode})  # errors are recorded
                    res["pressure_before"], res["pressure_after"] = p0, pressure()
                    runs[who].append(res)
                    print(
                        f"[{key}] round {r} {who}: first {res.get('first_step_s', float('nan')):.1f}s "
                        f"steps {[round(s, 3) for s in res.get('step_s', [])]} {res.get('error', '')} "
                        f"({res['pressure_after']})",
                        file=sys.stderr,
                        flush=True,
                    )
            summary = {}
            for who, rs in runs.items():
                ok = [x for x in rs if "error" not in x]
                steps = [s for x in ok for s in x["step_s"]]
                rate = batch * seq / statistics.median(steps) if steps else None
                summary[who] = {
                    "steady_tokens_per_s": round(rate, 1) if rate else None,
                    "model_tflop_s": sig(rate * flops / 1e12) if rate else None,
                    "flops_utilisation": sig(rate * flops / 1e12 / ceiling["tflop_s"]) if rate else None,
                    "first_step_s": round(ok[0]["first_step_s"], 2) if ok else None,
                    "graphs": ok[0]["graphs"] if ok else None,
                    "errors": [x["error"] for x in rs if "error" in x],
                }
            o, t = summary["ours"], summary["transformers"]
            if o["steady_tokens_per_s"] and t["steady_tokens_per_s"]:
                summary["steady_ratio"] = round(o["steady_tokens_per_s"] / t["steady_tokens_per_s"], 3)
            if o["first_step_s"] and t["first_step_s"]:
                summary["first_step_ratio_theirs_over_ours"] = round(t["first_step_s"] / o["first_step_s"], 3)
            report["results"][key] = {"summary": summary, "runs": runs}
            _write(report, a.out)
    # packed: real tokens per second with ours, compiled, in the best precision available
    if a.no_packed:
        report["packed"] = {"skipped": "--no-packed"}
    else:
        try:
            best = "bf16" if "bf16" in a.precisions else "fp32"
            res = run_child(
                {
                    **base,
                    "who": "ours",
                    "precision": best,
                    "packing": True,
                    "mode": "compiled" if "compiled" in a.modes else "eager",
                }
            )
            if "error" in res:
                raise RuntimeError(res["error"])
            steady = statistics.median(res["step_s"])
            report["packed"] = {
                "precision": best,
                "real_tokens_per_s": round(batch * res["real_tokens_per_row"] / steady, 1),
                "positions_per_s": round(batch * seq / steady, 1),
                "padding_waste": round(res["padding_waste"], 4),
                "graphs": res["graphs"],
            }
            pr = report["results"].get(f"{best}-compiled", {}).get("summary", {}).get("ours", {})
            if pr.get("steady_tokens_per_s"):
                report["packed"]["padded_real_tokens_per_s"] = round(
                    pr["steady_tokens_per_s"] * (1 - padded.padding_waste), 1
                )
        except Exception as err:
            report["packed"] = {"error": f"{type(err).__name__}: {err}"[:500]}
    report["pressure_end"] = pressure()
    _write(report, a.out)
    print(json.dumps(report, indent=2, default=str))
    return 0


def _write(report: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2, default=str)


if __name__ == "__main__":
    sys.exit(main())
