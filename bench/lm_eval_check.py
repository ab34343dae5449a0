"""lm-evaluation-harness against our server: its `local-completions` model (OpenAI's completions API,
what evaluation fleets point at a served model) and its own `hf` model (transformers, in process) on
the same checkpoint and the same small local tasks, in the same run; their metrics must agree.

Why a script and not a test: lm-eval pulls in datasets, pandas, pyarrow, scikit-learn and more, too
heavy for `make test`. Install it apart from the project's environment, e.g.

    pip install --target /tmp/lmeval_pkgs --no-deps lm-eval <its dependencies missing here>
    PYTHONPATH=/tmp/lmeval_pkgs:src python bench/lm_eval_check.py --out bench/results/lm_eval_check.json

What it does:

- builds a tiny Qwen3 (random weights, drawn wide; hidden 64, 2 layers) with a Qwen-style tokenizer and chat
  template (the test fixtures'), saved in Hugging Face format;
- writes two local tasks (JSON lines, no download): `sf_tiny_mc`, multiple choice, scored by
  loglikelihood (`echo` with `logprobs`, max_tokens 1: the prompt's log-probabilities from our scoring
  prefill), metrics acc and acc_norm; `sf_tiny_gen`, generate_until (greedy, stop "\\n", 8 tokens),
  metric exact_match;
- serves the checkpoint in this process (`serving.server.Server`, eager steps) and runs lm-eval's
  `local-completions` model against it with the checkpoint's tokenizer (token ids sent), then lm-eval's
  `hf` model (float32) on the folder;
- compares: every metric equal; every loglikelihood within `LOGLIK_TOL` per token (fp32 sums of
  log-softmax terms, computed by two implementations in another order); every is-greedy flag and every
  generated text equal.

Prints one JSON object (and writes it with `--out`); exits 1 when they disagree.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the tiny model and tokenizer builders
sys.path.insert(0, os.path.join(ROOT, "src"))

# per token: fp32 log-softmax (|logit| < 10, vocab < 1000) computed in two orders drifts by ~1e-6; a wrong token,
# position or mask moves it by 1e-2 or more. A choice's loglikelihood sums at most MAX_TOKENS of them.
LOGLIK_TOL = 1e-4
MAX_TOKENS = 16

QUESTIONS = [
    ("What does a for statement do?", ["It loops", "It stops", "It prints", "It sleeps"], 0, "It loops"),
    ("Which word is a colour?", ["table", "green", "seven", "run"], 1, "green"),
    ("What is two plus two?", ["three", "five", "four", "ten"], 2, "four"),
    ("Where do fish live?", ["in trees", "in the sky", "in sand", "in water"], 3, "in water"),
    ("What is a list in Python?", ["an ordered collection", "a loop", "a number", "a file"], 0, "a collection"),
    ("Which one is a fruit?", ["stone", "apple", "chair", "cloud"], 1, "apple"),
    ("What does return do?", ["ends a loop", "imports", "gives back a value", "prints"], 2, "gives back a value"),
    ("Which animal barks?", ["cat", "cow", "bird", "dog"], 3, "dog"),
]


def build_model(folder: str) -> None:
    from tiny import build_hf_model
    from tokenizer_fixtures import build_qwen

    from staticformers import AutoTokenizer

    build_qwen(Path(folder))
    tok = AutoTokenizer.from_pretrained(folder)
    # weights drawn 10x wider than transformers' default: a model this small otherwise answers every
    # prompt with one repeated token, and generations that differ per prompt test more
    build_hf_model(
        "qwen3", vocab_size=len(tok), max_position_embeddings=256, eos_token_id=tok.eos_token_id, initializer_range=0.2
    ).save_pretrained(folder)


def write_tasks(folder: str) -> None:
    data = os.path.join(folder, "data.jsonl")
    with open(data, "w", encoding="utf-8") as f:
        for q, choices, answer, short in QUESTIONS:
            f.write(json.dumps({"question": q, "choices": choices, "answer": answer, "short": short}) + "\n")
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    with open(os.path.join(folder, "sf_tiny_mc.yaml"), "w", encoding="utf-8") as f:
        f.write(
            "task: sf_tiny_mc\n" + common + "output_type: multiple_choice\n"
            'doc_to_text: "Question: {{question}}\\nAnswer:"\n'
            'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
            "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
            "  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\n"
        )
    with open(os.path.join(folder, "sf_tiny_gen.yaml"), "w", encoding="utf-8") as f:
        f.write(
            "task: sf_tiny_gen\n" + common + "output_type: generate_until\n"
            'doc_to_text: "Q: {{question}}\\nA:"\ndoc_to_target: "{{short}}"\n'
            'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 8\n  do_sample: false\n'
            "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
        )


def evaluate(model: str, model_args: dict, tasks_dir: str) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    start = time.perf_counter()
    out = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["sf_tiny_mc", "sf_tiny_gen"],
        task_manager=TaskManager(include_path=tasks_dir),
        log_samples=True,
        batch_size=1,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )
    metrics = {
        task: {k: v for k, v in values.items() if k.split(",")[0] in ("acc", "acc_norm", "exact_match")}
        for task, values in out["results"].items()
    }
    samples = {}
    for task, rows in out["samples"].items():
        for row in rows:
            samples[(task, row["doc_id"])] = row["resps"]
    return {"metrics": metrics, "samples": samples, "seconds": round(time.perf_counter() - start, 2)}


def compare(ours: dict, theirs: dict) -> dict:
    worst, problems, counted = 0.0, [], {"loglikelihoods": 0, "generations": 0}
    if set(ours["samples"]) != set(theirs["samples"]):
        problems.append({"documents differ": sorted(set(ours["samples"]) ^ set(theirs["samples"]))})
    for key, resps in theirs["samples"].items():
        mine = ours["samples"].get(key, [])
        if len(mine) != len(resps):
            problems.append({"sample": list(key), "ours": len(mine), "hf": len(resps)})
        for a, b in zip(mine, resps):
            a, b = a[0], b[0]
            if isinstance(b, (list, tuple)):  # loglikelihood: (logprob, is_greedy)
                counted["loglikelihoods"] += 1
                worst = max(worst, abs(float(a[0]) - float(b[0])))
                if abs(float(a[0]) - float(b[0])) > LOGLIK_TOL * MAX_TOKENS or bool(a[1]) != bool(b[1]):
                    problems.append({"sample": list(key), "ours": a, "hf": b})
            else:
                counted["generations"] += 1
                if a != b:
                    problems.append({"sample": list(key), "ours": a, "hf": b})
    if not counted["loglikelihoods"] or not counted["generations"]:
        problems.append({"nothing compared": counted})
    if ours["metrics"] != theirs["metrics"]:
        problems.append({"metrics": {"ours": ours["metrics"], "hf": theirs["metrics"]}})
    return {
        "compared": counted,
        "max_loglikelihood_difference": worst,
        "problems": problems,
        "generations": sorted(
            {str(r[0]) for rs in ours["samples"].values() for r in rs if not isinstance(r[0], (list, tuple))}
        )[:8],
    }


def pressure() -> str:
    try:
        with open("/proc/pressure/cpu", encoding="utf-8") as f:
            return f.readline().strip()
    except OSError:
        return "unavailable"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="write the JSON result here too")
    args = p.parse_args()
    import lm_eval
    import torch

    from staticformers import AutoModelForCausalLM, AutoTokenizer
    from staticformers.serving.server import ServeOptions, Server, build_loop, build_state

    torch.manual_seed(0)
    before = pressure()
    with tempfile.TemporaryDirectory() as tmp:
        folder, tasks = os.path.join(tmp, "model"), os.path.join(tmp, "tasks")
        os.makedirs(tasks)
        build_model(folder)
        write_tasks(tasks)
        opts = ServeOptions(
            model=folder, served_model_name="tiny", backend="eager", max_batch_size=4, max_model_len=256
        )
        model, tok = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
        server = Server(build_state(model, tok, build_loop(model, opts), opts), grace=2.0)
        server.start()
        try:
            ours = evaluate(
                "local-completions",
                {
                    "model": "tiny",
                    "base_url": server.url + "/v1/completions",
                    "tokenizer_backend": "huggingface",
                    "tokenizer": folder,
                    "tokenized_requests": True,
                    "num_concurrent": 1,
                    "max_retries": 1,
                    "max_length": 256,
                },
                tasks,
            )
        finally:
            server.stop()
        theirs = evaluate("hf", {"pretrained": folder, "dtype": "float32", "device": "cpu"}, tasks)
    result = {
        "lm_eval": getattr(lm_eval, "__version__", "?"),
        "tasks": ["sf_tiny_mc", "sf_tiny_gen"],
        "documents": len(QUESTIONS),
        "ours": {"metrics": ours["metrics"], "seconds": ours["seconds"]},
        "hf": {"metrics": theirs["metrics"], "seconds": theirs["seconds"]},
        **compare(ours, theirs),
        "cpu_pressure_before": before,
        "cpu_pressure_after": pressure(),
        "machine": "2-core CPU shared with other engineers' jobs (noisy): seconds are not comparable",
    }
    result["agree"] = not result["problems"]
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0 if result["agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
