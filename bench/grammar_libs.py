"""Benchmark: the two grammar libraries on the index, xgrammar and llguidance, on our vocabularies.

For each tokenizer (the tests' tiny Qwen-style byte-level BPE, ~600 tokens; a byte-level BPE of the
reference checkpoint's vocabulary size, 32,000, trained here on Python's standard library, since the
reference checkpoint's own benchmark tokenizer is word-level `w<id>` words with no JSON characters) and
each library, in the same process:

- `tokenizer_s`: building the library's tokenizer object (once per server);
- `compile_ms`: compiling each grammar (a JSON schema, any JSON object, a regex, a small EBNF), cold;
- `step_overhead` (32k only): one decode step of 16 JSON-schema rows, our own code: the mask's host fill
  for the 16 rows and `RowSampler.choose` with the mask, against a free greedy batch's `choose`;
- `mask_us`: the host time to fill one row of the packed `[1, ceil(vocab/32)]` int32 bitmask, per token,
  walking a valid answer token by token (mean, median, max), plus advancing the matcher by that token.

    python bench/grammar_libs.py --out bench/results/grammar_libs.json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from reference import pressure  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
        "kind": {"enum": ["person", "robot"]},
    },
    "required": ["name", "age", "tags", "kind"],
    "additionalProperties": False,
}
ANSWER_SCHEMA = '{"name": "Ada Lovelace", "age": 36, "tags": ["a", "c"], "kind": "person"}'
REGEX = r"\d{3}-[a-z]{2,6}(\.[a-z]+)?"
ANSWER_REGEX = "123-hello.world"
EBNF = 'root ::= "(" expr ")"\nexpr ::= term (("+" | "*") term)*\nterm ::= [0-9]+ | "(" expr ")"\n'
LARK = 'start: "(" expr ")"\nexpr: term (("+" | "*") term)*\nterm: /[0-9]+/ | "(" expr ")"\n'
ANSWER_EBNF = "(12+(3*45)+6)"


def tokenizers_under_test(root: str) -> dict:
    """name -> (tokenizer.json text, eos id, folder)."""
    from tokenizer_fixtures import build_qwen

    tiny = build_qwen(__import__("pathlib").Path(root) / "tiny")
    return {"tiny_bpe": str(tiny), "bpe32k": byte_level_bpe(os.path.join(root, "bpe32k"))}


def byte_level_bpe(big: str, vocab: int = 32000) -> str:
    """A byte-level BPE of `vocab` tokens (Qwen's split regex, ChatML specials) trained on Python's standard
    library, saved as a tokenizer folder `big`; returns it."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from tokenizer_fixtures import QWEN_SPLIT

    os.makedirs(big, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        show_progress=False,
    )
    tok.train(files, trainer)
    tok.save(os.path.join(big, "tokenizer.json"))
    with open(os.path.join(big, "tokenizer_config.json"), "w") as f:
        json.dump(
            {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "model_max_length": 1 << 20}, f
        )
    return big


def walk(tokenizer, text: str) -> list:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def bench_llguidance(tok, vocab: int, eos: int, grammars: dict) -> dict:
    import llguidance
    import llguidance.torch as lt

    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok.backend_tokenizer.to_str(), n_vocab=vocab, eos_token=eos)
    out = {"tokenizer_s": round(time.perf_counter() - t0, 3)}
    bitmask = lt.allocate_token_bitmask(1, vocab)
    for name, (kind, source, answer) in grammars.items():
        t0 = time.perf_counter()
        if kind == "schema":
            g = llguidance.LLMatcher.grammar_from_json_schema(source, defaults={"whitespace_flexible": True})
        elif kind == "json":
            g = llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"}, defaults={"whitespace_flexible": True}
            )
        elif kind == "regex":
            g = llguidance.LLMatcher.grammar_from_regex(source)
        else:
            g = llguidance.LLMatcher.grammar_from_lark(source[1])
        m = llguidance.LLMatcher(lltok, g, log_level=0)
        compile_ms = (time.perf_counter() - t0) * 1e3
        assert not m.is_error(), m.get_error()
        times = []
        for t in walk(tok, answer):
            t0 = time.perf_counter()
            lt.fill_next_token_bitmask(m, bitmask, 0)
            ok = m.consume_token(t)
            times.append(time.perf_counter() - t0)
            assert ok, (name, t, m.get_error())
        out[name] = {"compile_ms": round(compile_ms, 2), **_stats(times), "accepting": m.is_accepting()}
    return out


def bench_xgrammar(tok, vocab: int, eos: int, grammars: dict) -> dict:
    import xgrammar as xgr

    t0 = time.perf_counter()
    backend = tok.backend_tokenizer.to_str()
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend)
    encoded = [""] * vocab
    for token, i in tok.get_vocab().items():
        if i < vocab:
            encoded[i] = token
    info = xgr.TokenizerInfo(
        encoded, meta["vocab_type"], vocab_size=vocab, stop_token_ids=[eos], add_prefix_space=meta["add_prefix_space"]
    )
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    out = {"tokenizer_s": round(time.perf_counter() - t0, 3)}
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    for name, (kind, source, answer) in grammars.items():
        t0 = time.perf_counter()
        if kind == "schema":
            c = compiler.compile_json_schema(json.dumps(source), any_whitespace=True, strict_mode=True)
        elif kind == "json":
            c = compiler.compile_builtin_json_grammar()
        elif kind == "regex":
            c = compiler.compile_regex(source)
        else:
            c = compiler.compile_grammar(source[0])
        m = xgr.GrammarMatcher(c)
        compile_ms = (time.perf_counter() - t0) * 1e3
        times = []
        for t in walk(tok, answer):
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(bitmask, 0)
            ok = m.accept_token(t)
            times.append(time.perf_counter() - t0)
            assert ok, (name, t)
        out[name] = {
            "compile_ms": round(compile_ms, 2),
            **_stats(times),
            "accepting": m.is_terminated() or m.accept_token(eos),
        }
    return out


def step_overhead(tok, vocab: int, rows: int = 16, steps: int = 40) -> dict:
    """What one decode step of `rows` JSON-schema rows adds on the host and in the sampler, our own code
    (`RowConstraints.fill`, `RowSampler.choose` with the mask) against a free greedy batch's `choose` (the
    graph's argmax as it is): medians over `steps` steps, rows walking a valid answer."""
    import torch

    from staticformers.generation.constraints import RowConstraints, StructuredOutputs, compiler_for
    from staticformers.generation.sampling import RowSampler, SamplingParams

    grammar = compiler_for(tok, vocab).compile(StructuredOutputs(json=SCHEMA))
    answer = walk(tok, ANSWER_SCHEMA)
    constraints, sampler = RowConstraints(rows, vocab), RowSampler(rows, vocab, torch.device("cpu"))
    for r in range(rows):
        constraints.set_row(r, grammar, ())
        sampler.set_row(r, SamplingParams(), [1])
    logits, argmax = torch.randn(rows, vocab), torch.zeros(rows, dtype=torch.long)
    fill, masked, free = [], [], []
    for i in range(min(steps, len(answer) - 1)):
        t0 = time.perf_counter()
        mask = constraints.fill(list(range(rows)))
        t1 = time.perf_counter()
        sampler.choose(logits, argmax, list(range(rows)), [i] * rows, mask)
        t2 = time.perf_counter()
        sampler.choose(logits, argmax, list(range(rows)), [i] * rows)
        t3 = time.perf_counter()
        fill.append(t1 - t0)
        masked.append(t2 - t1)
        free.append(t3 - t2)
        for r in range(rows):
            constraints.advance(r, answer[i])
    ms = lambda xs: round(statistics.median(xs) * 1e3, 3)  # noqa: E731
    return {
        "rows": rows,
        "vocab": vocab,
        "steps": len(fill),
        "mask_fill_ms": ms(fill),
        "choose_with_mask_ms": ms(masked),
        "choose_free_greedy_ms": ms(free),
    }


def _stats(times: list) -> dict:
    us = sorted(t * 1e6 for t in times)
    return {
        "tokens": len(us),
        "mask_us_mean": round(statistics.mean(us), 1),
        "mask_us_median": round(statistics.median(us), 1),
        "mask_us_max": round(us[-1], 1),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from staticformers import AutoTokenizer

    grammars = {
        "json_schema": ("schema", SCHEMA, ANSWER_SCHEMA),
        "json_object": ("json", None, ANSWER_SCHEMA),
        "regex": ("regex", REGEX, ANSWER_REGEX),
        "ebnf": ("ebnf", (EBNF, LARK), ANSWER_EBNF),
    }
    result = {"pressure_before": pressure(), "machine": "2-core CPU shared with 4 engineers", "tokenizers": {}}
    with tempfile.TemporaryDirectory() as root:
        for name, folder in tokenizers_under_test(root).items():
            tok = AutoTokenizer.from_pretrained(folder)
            vocab, eos = len(tok), tok.convert_tokens_to_ids("<|im_end|>")
            row = {"vocab": vocab}
            for lib, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
                row[lib] = fn(tok, vocab, eos, grammars)
            if vocab >= 32000:
                row["step_overhead"] = step_overhead(tok, vocab)
            result["tokenizers"][name] = row
    result["pressure_after"] = pressure()
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
