"""LoRA fine-tuning: staticformers' Trainer with an adapter against transformers + peft's Trainer, same run.

    .venv/bin/python bench/lora.py [--steps 6] [--rounds 2] [--modes eager,compiled]

The reference checkpoint (bench/reference.py, `--size 41m` by default: Qwen3-shaped, 41.6M parameters)
is loaded in bfloat16 by both; both add a LoRA adapter of rank `--r 16` (alpha 32, dropout 0) on q, k, v,
o, gate, up and down, and train it alone with bf16 on the same padded rows `[--batch 8, --seq 256]`
(bench/train.py's documents), AdamW, lr 1e-4, on `--device`. Ours: `add_adapter(LoraConfig(...))`, the
Trainer's bf16 recipe (bf16 adapter weights with fp32 masters; the base stays bf16 and is never
copied). Theirs: `peft.get_peft_model` (adapter in fp32, PEFT's default) and transformers' Trainer with
`bf16=True` (autocast). Compiled: ours `torch_compile=True` with inductor, theirs `torch_compile=True`.

The two run interleaved A B A B (`--rounds`), each in a fresh process with a fresh model. Reported per
mode: first-step seconds (round 1, cold compile caches for both), steady tokens/s (median period between
step ends after the first, all rounds), the process's peak memory (peak RSS on the CPU, read when the
run ends: loading included, the same for both; `torch.cuda.max_memory_allocated` on a GPU), graphs
compiled, trainable parameters, and the ratios (targets: tokens/s >= 1.3x theirs, peak memory <= theirs,
first step no slower). `/proc/pressure/cpu` is read before and after every run.

`--decode` also measures what serving an adapter unmerged costs: batch-1 greedy decode (`--new` tokens
after a 64-token prompt, bf16, the device's default compile) of the same model with one adapter of rank
`--r` merged (the floor), active and unmerged (the named path: on the CPU the base projections keep
their measured formulations, the adapters' products are added), and through an adapter bank of two
adapters (rows routed by index; whole-model graphs on the CPU). Each in a fresh process; decode
tokens/s after a warm-up call. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "src"))

from train import BATCH, LR, SEQ, _sync, documents, train_with_transformers  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peak_memory_mb(device: str) -> float:
    if device != "cpu":
        import torch

        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def run_ours(path: str, docs: list, mode: str, steps: int, r: int, *, device: str, batch: int, seq: int) -> dict:
    import torch

    from staticformers import AutoModelForCausalLM, LoraConfig, Trainer, TrainingArguments

    ends = []

    class Timed(Trainer):
        def clip_gradients(self):
            norm = super().clip_gradients()
            _sync(device)
            ends.append(time.perf_counter())
            return norm

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model.add_adapter(LoraConfig(r=r, lora_alpha=2 * r, target_modules=TARGETS))
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=batch,
        max_length=seq,
        max_steps=steps,
        learning_rate=LR,
        bf16=True,
        torch_compile=mode == "compiled",
        save_strategy="no",
        logging_steps=10**6,
        disable_tqdm=True,
        long_documents="truncate",
        use_cpu=device == "cpu",
    )
    trainer = Timed(model=model, args=args, train_dataset=docs)
    trainer.get_train_rows()
    start = time.perf_counter()
    out = trainer.train()
    return {
        "first_step_s": ends[0] - start,
        "step_s": [b - a for a, b in zip(ends, ends[1:])],
        "graphs": trainer.compile_stats()["train_graphs"],
        "loss": out.training_loss,
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "peak_mb": peak_memory_mb(device),
    }


def run_theirs(path: str, rows, mode: str, steps: int, r: int, *, device: str, batch: int) -> dict:
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model = peft.get_peft_model(
        model, peft.LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
    )
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=batch,
        max_steps=steps,
        learning_rate=LR,
        bf16=True,
        torch_compile=mode == "compiled",
        save_strategy="no",
        logging_steps=10**6,
        report_to="none",
        use_cpu=device == "cpu",
        dataloader_drop_last=True,
        disable_tqdm=True,
    )
    result = train_with_transformers(model, args, rows, device)
    return {
        **result,
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "peak_mb": peak_memory_mb(device),
    }


def run_decode(path: str, how: str, r: int, new: int, device: str) -> dict:
    """Batch-1 greedy decode tokens/s with one adapter merged, unmerged, or routed through a bank of two."""
    import torch

    from staticformers import AutoModelForCausalLM, LoraConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map=device)
    for i, name in enumerate(["a", "b"] if how == "bank" else ["a"]):
        torch.manual_seed(i)
        model.add_adapter(
            LoraConfig(r=r, lora_alpha=2 * r, target_modules=TARGETS, init_lora_weights=False), adapter_name=name
        )
    model.set_adapter("a")
    model.requires_grad_(False)
    if how == "merged":
        model.merge_and_unload()
    extra = {}
    if how == "bank":
        model.enable_adapter_batching()
        extra = {"adapter_names": ["a"]}
    prompt = torch.randint(3, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    model.generate(prompt, max_new_tokens=new, eos_token_id=None, **extra)  # compiles
    warm = time.perf_counter() - start
    times = []
    for _ in range(3):
        _sync(device)
        start = time.perf_counter()
        model.generate(prompt, max_new_tokens=new, eos_token_id=None, **extra)
        _sync(device)
        times.append(time.perf_counter() - start)
    return {
        "how": how,
        "tokens_per_s": round(new / statistics.median(times), 1),
        "first_call_s": round(warm, 1),
        "graphs": sum(row["graphs"] for row in model.compile_stats()),
    }


def run_child(spec: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": os.path.join(HERE, "..", "src")}
    if spec["device"].startswith("cuda:"):
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

    path = reference_dir(spec["size"])
    with open(os.path.join(path, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    if spec["who"] == "decode":
        print(json.dumps(run_decode(path, spec["how"], spec["r"], spec["new"], device)))
        return 0
    docs = documents(spec["documents"], vocab=vocab)
    if spec["who"] == "ours":
        res = run_ours(
            path, docs, spec["mode"], spec["steps"], spec["r"], device=device, batch=spec["batch"], seq=spec["seq"]
        )
    else:
        rows = build_rows(docs, None, spec["seq"], packing=False, long_documents="truncate")
        res = run_theirs(path, rows, spec["mode"], spec["steps"], spec["r"], device=device, batch=spec["batch"])
    print(json.dumps(res))
    return 0


def summarize(rs: list, batch: int, seq: int) -> dict:
    ok = [x for x in rs if "error" not in x]
    steps = [s for x in ok for s in x["step_s"]]
    rate = batch * seq / statistics.median(steps) if steps else None
    return {
        "steady_tokens_per_s": round(rate, 1) if rate else None,
        "first_step_s": round(ok[0]["first_step_s"], 2) if ok else None,
        "peak_mb": round(max(x["peak_mb"] for x in ok), 1) if ok else None,
        "graphs": ok[0]["graphs"] if ok else None,
        "trainable_parameters": ok[0]["trainable"] if ok else None,
        "loss": round(ok[0]["loss"], 4) if ok else None,
        "errors": [x["error"] for x in rs if "error" in x],
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "--_run":
        return child(json.loads(argv[1]))
    from reference import SIZES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", default="41m", choices=sorted(SIZES))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--documents", type=int, default=200)
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--seq", type=int, default=SEQ)
    parser.add_argument("--r", type=int, default=16, help="the adapters' rank (alpha = 2 r)")
    parser.add_argument("--modes", default="eager,compiled")
    parser.add_argument("--decode", action="store_true", help="also decode merged / unmerged / through a bank")
    parser.add_argument("--new", type=int, default=64, help="decode: new tokens per call")
    parser.add_argument("--out", default=None)
    a = parser.parse_args(argv)

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-lora-inductor-")  # cold for both
    from ceilings import check_device, device_info
    from reference import build_reference, pressure

    device = check_device(a.device)
    build_reference(size=a.size, device=str(device))
    report = {
        "model": f"reference Qwen3-shaped {a.size} (bench/reference.py), bf16",
        "batch": a.batch,
        "seq": a.seq,
        "r": a.r,
        "targets": TARGETS,
        "device": device_info(device),
        "pressure_start": pressure(),
        "results": {},
    }
    base = {
        "steps": a.steps,
        "documents": a.documents,
        "device": str(device),
        "size": a.size,
        "batch": a.batch,
        "seq": a.seq,
        "r": a.r,
    }
    for mode in a.modes.split(","):
        runs = {"ours": [], "peft": []}
        for rnd in range(a.rounds):
            for who in ("ours", "peft"):
                p0 = pressure()
                res = run_child({**base, "who": who, "mode": mode})
                res["pressure_before"], res["pressure_after"] = p0, pressure()
                runs[who].append(res)
                print(
                    f"[{mode}] round {rnd} {who}: first {res.get('first_step_s', float('nan')):.1f}s steps "
                    f"{[round(s, 3) for s in res.get('step_s', [])]} peak {res.get('peak_mb')} MB "
                    f"{res.get('error', '')}",
                    file=sys.stderr,
                    flush=True,
                )
        summary = {who: summarize(rs, a.batch, a.seq) for who, rs in runs.items()}
        o, t = summary["ours"], summary["peft"]
        if o["steady_tokens_per_s"] and t["steady_tokens_per_s"]:
            summary["steady_ratio"] = round(o["steady_tokens_per_s"] / t["steady_tokens_per_s"], 3)
        if o["first_step_s"] and t["first_step_s"]:
            summary["first_step_ratio_theirs_over_ours"] = round(t["first_step_s"] / o["first_step_s"], 3)
        if o["peak_mb"] and t["peak_mb"]:
            summary["peak_memory_ratio_ours_over_theirs"] = round(o["peak_mb"] / t["peak_mb"], 3)
        report["results"][mode] = {"summary": summary, "runs": runs}
        if a.out:
            with open(a.out, "w") as f:
                json.dump(report, f, indent=2, default=str)
    if a.decode:
        report["decode"] = {}
        for how in ("merged", "unmerged", "bank"):
            res = run_child({**base, "who": "decode", "how": how, "new": a.new})
            report["decode"][how] = res
            print(f"[decode] {how}: {res}", file=sys.stderr, flush=True)
        merged = report["decode"]["merged"].get("tokens_per_s")
        for how in ("unmerged", "bank"):
            rate = report["decode"][how].get("tokens_per_s")
            if merged and rate:
                report["decode"][f"{how}_over_merged"] = round(rate / merged, 3)
    report["pressure_end"] = pressure()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=2, default=str)
    print(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
