"""Benchmark: encode ~10 MB of text in batches, staticformers vs transformers' fast tokenizer, same run.

Trains a byte-level BPE (Qwen-like split regex, 8k vocab) on a slice of the text, saves it as a
Hugging Face folder, loads it with both libraries, checks the outputs are identical, then times
each library on the same batches, interleaved A B A B, and prints medians, the ratio and the CPU
pressure (/proc/pressure/cpu) before and after as JSON.

    .venv/bin/python bench/tokenization.py [--mb 10] [--reps 3] [--batch 256]
"""

from __future__ import annotations

import sys
from pathlib import Path

import argparse
import json
import os
import random
import statistics
import tempfile
import time
import warnings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference import pressure as cpu_pressure  # noqa: E402


def make_text(megabytes: float, seed: int = 0) -> list[str]:
    from tokenizer_fixtures import CORPUS

    rng = random.Random(seed)
    words = " ".join(CORPUS).split()
    docs, size = [], 0
    while size < megabytes * 1e6:
        doc = " ".join(rng.choice(words) for _ in range(rng.randint(20, 400)))
        docs.append(doc)
        size += len(doc.encode("utf-8"))
    return docs


def build(folder: Path, docs: list[str]) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from tokenizer_fixtures import QWEN_SPLIT

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=8000,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        show_progress=False,
    )
    tok.train_from_iterator(docs[:2000], trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "Qwen2Tokenizer",
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "bos_token": None,
                "model_max_length": 131072,
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=10.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--max-length", type=int, default=512)
    args = parser.parse_args()

    import torch
    import transformers

    from staticformers import AutoTokenizer

    pressure_before = cpu_pressure()
    docs = make_text(args.mb)
    batches = [docs[i : i + args.batch] for i in range(0, len(docs), args.batch)]
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp), docs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = transformers.AutoTokenizer.from_pretrained(tmp)
        ours = AutoTokenizer.from_pretrained(tmp)

    modes = {
        "padded_pt": dict(padding="max_length", truncation=True, max_length=args.max_length, return_tensors="pt"),
        "lists": dict(),
    }
    for kwargs in modes.values():  # identical outputs before timing anything
        a, b = ours(batches[0], **kwargs), ref(batches[0], **kwargs)
        for key in ("input_ids", "attention_mask"):
            same = torch.equal(a[key], b[key]) if kwargs else a[key] == b[key]
            assert same, f"outputs differ on {key}"

    def run(tok, kwargs) -> float:
        start = time.perf_counter()
        for batch in batches:
            tok(batch, **kwargs)
        return time.perf_counter() - start

    results = {}
    for mode, kwargs in modes.items():
        run(ours, kwargs), run(ref, kwargs)  # warm-up
        times = {"staticformers": [], "transformers": []}
        for _ in range(args.reps):  # interleaved A B A B
            times["staticformers"].append(run(ours, kwargs))
            times["transformers"].append(run(ref, kwargs))
        med_ours = statistics.median(times["staticformers"])
        med_ref = statistics.median(times["transformers"])
        results[mode] = {
            "staticformers_s": round(med_ours, 3),
            "transformers_s": round(med_ref, 3),
            "speedup_vs_transformers": round(med_ref / med_ours, 3),
            "staticformers_MB_per_s": round(args.mb / med_ours, 2),
            "all_s": {k: [round(t, 3) for t in v] for k, v in times.items()},
        }
    print(
        json.dumps(
            {
                "bench": "tokenize",
                "megabytes": args.mb,
                "texts": len(docs),
                "batch": args.batch,
                "reps": args.reps,
                "max_length": args.max_length,
                "cpus": os.cpu_count(),
                "tokenizers_threads": os.environ.get("RAYON_NUM_THREADS", "default"),
                "transformers": transformers.__version__,
                "results": results,
                "cpu_pressure_before": pressure_before,
                "cpu_pressure_after": cpu_pressure(),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
