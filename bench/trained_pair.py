"""A target and a small draft trained on the same synthetic corpus, for `bench/speculative.py --modes ...
trained_draft`: the reference checkpoint has random weights, so a draft cannot learn "the same data" as it.

The corpus has learnable structure and copied spans:
- a low-entropy Markov chain over `states` tokens of the vocabulary (ids 10 .. 10+states-1): from each
  state the chain goes to its main successor with probability `main` and to one of 3 alternates
  otherwise;
- copied spans: at each position, with probability `copy_rate`, a span of 8-24 earlier tokens of the same
  document is repeated, then the chain goes on from its last token (what prompt lookup can copy).

Both models use the reference's tokenizer-sized vocabulary (32000 ids, tied head): the target has the
reference's shape (bench/reference.py SIZES["41m"]), the draft 2 layers of hidden 256 (its head is a
32000 x 256 matrix, most of its bytes). Both are trained by a short plain loop (AdamW, cross-entropy on
next tokens, float32, the same batches in the same order), which is all the bench needs: the library's
Trainer adds nothing measured here. The pair is cached under ~/.cache/staticformers/bench/ keyed by a
hash of these settings, so a rerun loads it. The report holds each model's held-out loss (against the
chain's own entropy, the floor), the loss at the start, the training time, and how often each model's
greedy continuation of held-out documents takes the chain's main successor.

    python bench/trained_pair.py          # trains (or loads) the pair and prints its report
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference import SIZES  # noqa: E402

from staticformers import AutoConfig, AutoModelForCausalLM  # noqa: E402


@dataclass(frozen=True)
class PairSettings:
    states: int = 256
    main: float = 0.85
    copy_rate: float = 1 / 48
    seq: int = 128
    batch: int = 8
    steps: int = 120
    lr: float = 2e-3
    warmup: int = 10
    draft_layers: int = 2
    draft_hidden: int = 256
    seed: int = 0
    version: int = 1  # bump when the code changes what is trained

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


@dataclass
class Pair:
    target: object
    draft: object
    settings: PairSettings
    report: dict


class Chain:
    """The corpus's Markov chain: `succ[s]` each state's successors (main first), `probs` their weights."""

    def __init__(self, s: PairSettings):
        rng = np.random.default_rng(s.seed)
        self.base, self.states = 10, s.states
        self.succ = np.stack([rng.permutation(s.states)[:4] for _ in range(s.states)])  # [states, 4]
        self.probs = np.array([s.main] + [(1 - s.main) / 3] * 3)
        self.copy_rate = s.copy_rate

    def entropy(self) -> float:
        """Nats per token of the chain's transitions (the copies make the true floor a little lower)."""
        return float(-(self.probs * np.log(self.probs)).sum())

    def document(self, length: int, rng: np.random.Generator) -> list[int]:
        out = [int(rng.integers(self.states))]
        while len(out) < length:
            if len(out) > 32 and rng.random() < self.copy_rate:
                span = int(rng.integers(8, 25))
                start = int(rng.integers(0, len(out) - span))
                out += out[start : start + span]
                continue
            out.append(int(self.succ[out[-1], rng.choice(4, p=self.probs)]))
        return [self.base + t for t in out[:length]]

    def main_successor(self, token: int) -> int:
        return self.base + int(self.succ[token - self.base, 0]) if 0 <= token - self.base < self.states else -1


def corpus_prompts(s: PairSettings, batch: int, length: int, seed: int) -> list[list[int]]:
    """`batch` extractive prompts from held-out documents: a document of `length - 16` tokens, then 16 of
    its tokens from its middle (as bench/speculative.py's `extractive_prompts`)."""
    chain, rng = Chain(s), np.random.default_rng(10_000 + seed)
    out = []
    for _ in range(batch):
        doc = chain.document(length - 16, rng)
        start = len(doc) // 3
        out.append(doc + doc[start : start + 16])
    return out


def _config(s: PairSettings, draft: bool):
    shape = dict(SIZES["41m"])
    if draft:
        h = s.draft_hidden
        shape.update(
            hidden_size=h,
            intermediate_size=3 * h,
            num_hidden_layers=s.draft_layers,
            num_attention_heads=max(1, h // 64),
            num_key_value_heads=max(1, h // 128),
            head_dim=64,
        )
    return AutoConfig.for_model("qwen3", **shape)


def _batches(s: PairSettings, chain: Chain, count: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.tensor([[chain.document(s.seq, rng) for _ in range(s.batch)] for _ in range(count)])


def held_out_loss(model, data: torch.Tensor) -> float:
    """Mean next-token cross-entropy (nats) over `data` `[batches, batch, seq]`."""
    with torch.no_grad():
        return round(statistics.mean(float(model(input_ids=x, labels=x).loss) for x in data), 4)


def greedy_follows(model, chain: Chain, prompts: torch.Tensor, new: int = 32) -> float:
    """The fraction of greedy next tokens (no cache, plain forward) that are the chain's main successor of
    the token before."""
    hits = total = 0
    with torch.no_grad():
        ids = prompts
        for _ in range(new):
            nxt = model(input_ids=ids, logits_to_keep=1).logits[:, -1].argmax(-1)
            hits += sum(int(n) == chain.main_successor(int(p)) for n, p in zip(nxt, ids[:, -1]))
            total += len(nxt)
            ids = torch.cat([ids, nxt[:, None]], 1)
    return round(hits / total, 3)


def train(model, data: torch.Tensor, s: PairSettings, label: str) -> dict:
    """A plain AdamW loop over `data` `[steps, batch, seq]`, linear warm-up then cosine decay."""
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.0, betas=(0.9, 0.95))
    model.train()
    losses, start = [], time.perf_counter()
    for step, x in enumerate(data):
        lr = s.lr * min(1.0, (step + 1) / s.warmup) * 0.5 * (1 + math.cos(math.pi * step / len(data)))
        for g in opt.param_groups:
            g["lr"] = lr
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if step % 20 == 0 or step == len(data) - 1:
            print(
                f"{label} step {step} loss {losses[-1]:.3f} ({time.perf_counter() - start:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    model.eval()
    return {
        "first_loss": round(losses[0], 3),
        "last_loss": round(losses[-1], 3),
        "train_seconds": round(time.perf_counter() - start, 1),
    }


def cache_dir(s: PairSettings) -> str:
    root = os.environ.get("STATICFORMERS_BENCH_CACHE") or os.path.expanduser("~/.cache/staticformers/bench")
    return os.path.join(root, f"trained-pair-{s.key()}")


def trained_pair(s: PairSettings = PairSettings()) -> Pair:
    """The trained pair for `s`: loaded from its cache folder, else trained and saved there."""
    folder = cache_dir(s)
    marker = os.path.join(folder, "report.json")
    if os.path.exists(marker):
        with open(marker) as f:
            report = json.load(f)
        report["cached"] = True
        return Pair(
            AutoModelForCausalLM.from_pretrained(os.path.join(folder, "target")).eval(),
            AutoModelForCausalLM.from_pretrained(os.path.join(folder, "draft")).eval(),
            s,
            report,
        )
    chain = Chain(s)
    data = _batches(s, chain, s.steps, seed=s.seed + 1)
    held = _batches(s, chain, 4, seed=s.seed + 2)
    report = {
        "settings": asdict(s),
        "key": s.key(),
        "chain_entropy_nats": round(chain.entropy(), 4),
        "uniform_loss_nats": round(math.log(32000), 3),
    }
    models = {}
    for label in ("target", "draft"):
        model = AutoModelForCausalLM.from_config(_config(s, label == "draft"), seed=s.seed)
        entry = {"parameters": model.num_parameters()}
        entry.update(train(model, data, s, label))
        entry["held_out_loss"] = held_out_loss(model, held)
        entry["greedy_main_successor"] = greedy_follows(model, chain, held[0, :, :64])
        report[label] = entry
        models[label] = model
        print(label, json.dumps(entry), file=sys.stderr, flush=True)
    for label, model in models.items():
        model.save_pretrained(os.path.join(folder, label))
    with open(marker, "w") as f:
        json.dump(report, f, indent=1)
    report["cached"] = False
    return Pair(models["target"], models["draft"], s, report)


if __name__ == "__main__":
    print(json.dumps(trained_pair().report, indent=1))
