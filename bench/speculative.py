"""Speculative decoding on the reference model: decode tokens/s without speculation, with prompt lookup and
with a draft model, batch 1 and 8, the same run, interleaved A B A B; acceptance reported.

The reference checkpoint (bench/reference.py, 41.6M parameters, float32) has random weights. Prompts are
extractive in shape: a document of random tokens, then a span of it as the question (a model that answers
by copying continues the span). The draft is the target's first `--draft-layers` layers with its
embedding, final norm and head (a layer-skipping draft that needs no training and shares the tokenizer;
the run says how often the target agreed with it).

`--modes ... trained_draft` (or `--target trained`) runs on a trained pair instead (bench/trained_pair.py:
a target of the reference's shape and a 2-layer draft, trained on the same synthetic corpus, cached), with
prompts drawn from that corpus's held-out documents.

`--k` takes several values: each speculating mode runs at each k in the same process and plan (labelled
`lookup_k8`, ...). The default, 4 and 8, holds the best k of each batch on the 2-core CPU this was measured
on (BENCHMARKS.md: 8 at batch 1, 4 at batch 8). Greedy runs check every mode's tokens equal to the mode
without speculation; `--temperature` samples instead (a seed per row; tokens not compared, the
distribution is what speculation keeps). Prints one JSON object (written to `--out` as well): per batch and
mode, time to first token, decode tokens/s (after the first token), the ratio to no speculation, proposed
and accepted tokens and the acceptance rate, verify steps, graphs compiled while timed (0 expected), the
host-side cost of the n-gram search, and /proc/pressure/cpu before and after.

    python bench/speculative.py --batches 1 8 --modes none lookup --repeats 3 --out bench/results/speculative.json
    python bench/speculative.py --modes none lookup trained_draft --k 4 8 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference import SIZES, build_reference, pressure, reference_dir  # noqa: E402
from reference import report as write_report  # noqa: E402

from staticformers import AutoModelForCausalLM, CompileConfig, ShapePlan  # noqa: E402
from staticformers.generation.engines import compile_settings, engine_for  # noqa: E402
from staticformers.generation.generation_config import GenerationConfig  # noqa: E402
from staticformers.generation.loop import GenerationLoop, GenerationRequest  # noqa: E402
from staticformers.generation.sampling import SamplingParams  # noqa: E402
from staticformers.generation.speculative.draft import DraftModel  # noqa: E402
from staticformers.generation.speculative.prompt_lookup import PromptLookup, lookup  # noqa: E402
from staticformers.generation.speculative.step import Speculator  # noqa: E402


def extractive_prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """`batch` prompts of `length` tokens: a random document, then 16 of its tokens from its middle."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(batch):
        doc = torch.randint(10, vocab, (length - 16,), generator=gen).tolist()
        start = len(doc) // 3
        out.append(doc + doc[start : start + 16])
    return out


def layer_draft(ref_dir: str, layers: int):
    """The reference's first `layers` layers, its embedding, norm and head: a draft sharing the tokenizer."""
    from staticformers import AutoConfig

    target = AutoModelForCausalLM.from_pretrained(ref_dir)
    cfg = AutoConfig.for_model("qwen3", **{**SIZES["41m"], "num_hidden_layers": layers})
    draft = AutoModelForCausalLM.from_config(cfg)
    missing, _ = draft.load_state_dict(target.state_dict(), strict=False)
    assert not missing, missing
    return draft.eval()


def run_once(model, settings, plan, prompts: list, new: int, speculator=None, temperature=None) -> dict:
    """One generation of `prompts` (greedy, or sampled at `temperature` with a seed per row): its tokens, time
    to first token and decode seconds."""
    loop = GenerationLoop(engine_for(model), settings, plan, speculator=speculator)
    for i, p in enumerate(prompts):
        sampling = SamplingParams(do_sample=True, temperature=temperature, seed=i) if temperature else SamplingParams()
        loop.add(GenerationRequest(p, new, sampling, request_id=i))
    tokens: dict = {}
    start = time.perf_counter()
    first = None
    while not loop.idle:
        for event in loop.step():
            assert event.error is None, event.error
            tokens.setdefault(event.request_id, []).append(event.token)
        if first is None and len(tokens) == len(prompts):
            first = time.perf_counter()
    end = time.perf_counter()
    return {"tokens": [tokens[i] for i in range(len(prompts))], "ttft": first - start, "decode": end - first}


def lookup_cost_us(prompts: list, k: int, max_ngram: int) -> float:
    """The host-side n-gram search per row and step, in microseconds (median over the prompts)."""
    times = []
    for p in prompts:
        history = p + p[:64]
        start = time.perf_counter()
        for _ in range(100):
            lookup(history, k, max_ngram)
        times.append((time.perf_counter() - start) / 100 * 1e6)
    return round(statistics.median(times), 1)


def labelled(modes: list, ks: list) -> list:
    """(label, mode, k) for each mode, a speculating mode once per k (labelled `mode_k<k>` when several)."""
    out = []
    for mode in modes:
        if mode == "none":
            out.append(("none", mode, None))
        else:
            out += [(mode if len(ks) == 1 else f"{mode}_k{k}", mode, k) for k in ks]
    return out


def time_case(
    model, settings, plan, prompts: list, new: int, entries: list, repeats: int, engines: list, temperature=None
) -> dict:
    """One batch: warm every entry (label, make speculator) up, then time them interleaved A B C A B C; each
    entry's greedy tokens are checked equal to the first entry's (no speculation). Sampled rows
    (`temperature`) are not compared: speculation keeps their distribution, not their draws."""
    batch = len(prompts)
    case: dict = {"batch": batch}
    start = time.perf_counter()
    reference = None
    with torch.no_grad():
        for label, make in entries:  # warm-up: compiles every shape the mode uses
            out = run_once(model, settings, plan, prompts, new, make(), temperature)
            if label == "none" and not temperature:
                reference = out["tokens"]
    case["warmup_seconds"] = round(time.perf_counter() - start, 1)
    rows = {
        label: {"ttft": [], "decode": [], "drafted": 0, "accepted": 0, "steps": 0, "graphs": 0} for label, _ in entries
    }
    for _ in range(repeats):  # interleaved A B A B
        for label, make in entries:
            spec = make()
            before = sum(e.graph_count() for e in engines)
            with torch.no_grad():
                out = run_once(model, settings, plan, prompts, new, spec, temperature)
            r = rows[label]
            r["graphs"] += sum(e.graph_count() for e in engines) - before
            r["ttft"].append(out["ttft"])
            r["decode"].append(out["decode"])
            if reference is not None:
                assert out["tokens"] == reference, f"{label}: greedy tokens differ from no speculation"
            if spec is not None:
                r["drafted"] += spec.num_draft_tokens
                r["accepted"] += spec.num_accepted_tokens
                r["steps"] += spec.num_steps
    for label, r in rows.items():
        decode = statistics.median(r["decode"])
        entry = {
            "ttft_ms": round(statistics.median(r["ttft"]) * 1000, 1),
            "decode_tok_s": round(batch * (new - 1) / decode, 1),
            "decode_runs_s": [round(x, 3) for x in r["decode"]],
            "graphs_while_timed": r["graphs"],
        }
        if label != "none":
            entry.update(
                proposed=r["drafted"],
                accepted=r["accepted"],
                verify_steps=r["steps"],
                acceptance=round(r["accepted"] / max(r["drafted"], 1), 3),
                tokens_per_verify_row=round((r["accepted"] + r["steps"] * batch) / max(r["steps"] * batch, 1), 2),
            )
        case[label] = entry
    for label, _ in entries:
        if label != "none" and "none" in case:
            case[f"ratio_{label}_decode"] = round(case[label]["decode_tok_s"] / case["none"]["decode_tok_s"], 2)
    return case


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument(
        "--k",
        type=int,
        nargs="+",
        default=[4, 8],
        help="proposed tokens per step (num_speculative_tokens); several: each speculating mode at each k",
    )
    ap.add_argument("--ngram", type=int, default=4, help="prompt_lookup_max")
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--backend", default=None, help="torch.compile backend (default: the device's)")
    ap.add_argument(
        "--modes",
        nargs="+",
        default=["none", "lookup", "draft"],
        help="none, lookup, draft (the reference's first layers); trained_draft times a trained "
        "target with none, lookup (if asked) and its trained draft (bench/trained_pair.py)",
    )
    ap.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sample at this temperature (a seed per row) instead of greedy; tokens are then not compared",
    )
    ap.add_argument(
        "--target",
        choices=["reference", "trained", "both"],
        default=None,
        help="which target the modes run on (default: trained when trained_draft is asked, else reference)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    target = args.target or ("trained" if "trained_draft" in args.modes else "reference")
    if target == "reference" and "trained_draft" in args.modes:
        ap.error("trained_draft runs on the trained target: pass --target trained or both.")
    if target == "trained" and "draft" in args.modes:
        ap.error("draft (the reference's first layers) runs on the reference: pass --target reference or both.")

    report = {
        "pressure_before": pressure(),
        "threads": torch.get_num_threads(),
        "k": args.k,
        "ngram": args.ngram,
        "prompt": args.prompt,
        "new": args.new,
        "draft_layers": args.draft_layers,
        "temperature": args.temperature,
        "note": "machine shared with other work; see pressure_before/after",
        "cases": [],
    }
    config = GenerationConfig()
    cc = CompileConfig(backend=args.backend)
    kv = 1 << (args.prompt + args.new + max(args.k)).bit_length()
    plan = ShapePlan(
        batch_sizes=sorted(set(args.batches)),
        prompt_lengths=[args.prompt],
        kv_lengths=[kv],
        max_model_len=kv,
        extend_widths=[(k + 1, k + 1) for k in sorted(set(args.k))],
    )
    report["plan"] = str(plan)

    def write() -> None:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)

    def run_cases(model, drafts: dict, modes: list, prompts_for, section: str) -> None:
        """Time `modes` on `model` at every batch; `drafts` maps a draft mode to its model."""
        settings = compile_settings(model, config, cc)
        report["compile_backend"] = settings.label
        draft_settings = {m: compile_settings(d, config, cc) for m, d in drafts.items()}

        def make(mode: str, k):
            if mode == "lookup":
                return lambda: Speculator(PromptLookup(k, max_ngram=args.ngram))
            if mode in drafts:
                return lambda: Speculator(DraftModel(engine_for(drafts[mode]), draft_settings[mode], k))
            return lambda: None

        entries = [(label, make(mode, k)) for label, mode, k in labelled(modes, args.k)]
        engines = [engine_for(model)] + [engine_for(d) for d in drafts.values()]
        for batch in args.batches:
            prompts = prompts_for(batch)
            before = pressure()
            case = time_case(model, settings, plan, prompts, args.new, entries, args.repeats, engines, args.temperature)
            case = {
                "model": section,
                **case,
                "pressure_before": before,
                "pressure_after": pressure(),
                "lookup_host_us_per_row_step": lookup_cost_us(prompts, max(args.k), args.ngram),
            }
            report["cases"].append(case)
            print(json.dumps(case), file=sys.stderr, flush=True)
            write()

    with torch.no_grad():
        reference_modes = [m for m in args.modes if m != "trained_draft"]
        if target in ("reference", "both"):
            ref_dir = build_reference(reference_dir())
            model = AutoModelForCausalLM.from_pretrained(ref_dir)
            drafts = {"draft": layer_draft(ref_dir, args.draft_layers)} if "draft" in reference_modes else {}
            vocab = model.config.vocab_size
            run_cases(
                model, drafts, reference_modes, lambda b: extractive_prompts(b, args.prompt, vocab, seed=b), "reference"
            )
        if target in ("trained", "both"):
            from trained_pair import corpus_prompts, trained_pair

            pair = trained_pair()
            report["trained_pair"] = pair.report
            modes = [m for m in args.modes if m != "draft"]
            run_cases(
                pair.target,
                {"trained_draft": pair.draft},
                modes,
                lambda b: corpus_prompts(pair.settings, b, args.prompt, seed=1000 + b),
                "trained target",
            )
    report["pressure_after"] = pressure()
    write_report(report, args.out)


if __name__ == "__main__":
    main()
