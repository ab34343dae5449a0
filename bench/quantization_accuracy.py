"""What quantizing the lm_head costs in accuracy and saves in bytes (the head choice of `QuantizationConfig`).

Two models: the tiny Qwen3 that tests/test_quantization.py trains for a few seconds (a task with an entropy
floor, held in bf16), and the 41.6M reference checkpoint (bench/reference.py: random weights, so its
top-1 agreement reflects near-ties of flat logits, not accuracy). For each: bf16, int8 with the head exact,
int8 with the head int8 too: held-out loss, KL divergence per token from bf16, top-1 agreement with bf16
(teacher-forced), and the stored bytes. Prints JSON.

    python bench/quantization_accuracy.py > bench/results/quantization-head.json
"""

from __future__ import annotations

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # the trained tiny model's task and training loop
sys.path.insert(0, HERE)
from reference import reference_dir  # noqa: E402
from test_quantization import affine_rows, tiny_config, train  # noqa: E402

from staticformers import AutoModelForCausalLM, QuantizationConfig  # noqa: E402
from staticformers.models.quantization import weight_bytes  # noqa: E402

CHOICES = {"int8_head_exact": False, "int8_head_int8": True}


def measure(model, batch: torch.Tensor, ref_logits: torch.Tensor) -> dict:
    """Loss on `batch`, KL(bf16 || this) per token and top-1 agreement with bf16, teacher-forced."""
    with torch.no_grad():
        out = model(batch, labels=batch)
    kl = (
        torch.nn.functional.kl_div(
            out.logits.float().log_softmax(-1),
            ref_logits.float().log_softmax(-1),
            log_target=True,
            reduction="batchmean",
        ).item()
        / batch.shape[1]
    )
    top1 = (out.logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
    return {
        "loss": round(out.loss.item(), 5),
        "kl_per_token": kl,
        "top1_agreement": round(top1, 5),
        "bytes_stored": weight_bytes(model),
    }


def compare(load, batch: torch.Tensor) -> dict:
    """bf16 (`load(None)`) against each head choice (`load(QuantizationConfig)`) on `batch`."""
    base = load(None)
    with torch.no_grad():
        ref = base(batch, labels=batch)
    out = {"bf16": {"loss": round(ref.loss.item(), 5), "bytes_stored": weight_bytes(base)}}
    for name, head in CHOICES.items():
        out[name] = measure(
            load(QuantizationConfig("int8_weight_only", include_input_output_embeddings=head)), batch, ref.logits
        )
    return out


def main() -> None:
    torch.set_num_threads(1)
    trained = AutoModelForCausalLM.from_config(tiny_config(), seed=0)
    train(trained, 60, rows=8, length=96)
    state = trained.to(torch.bfloat16).state_dict()

    def tiny(config):
        model = AutoModelForCausalLM.from_config(tiny_config(), seed=0).to(torch.bfloat16)
        model.load_state_dict(state)
        if config is not None:
            model.quantize(config)
        return model

    path = reference_dir("41m")
    report = {
        "tiny_trained": compare(tiny, affine_rows(64, 96, seed=10_000)),
        "reference_41m_random": compare(
            lambda config: AutoModelForCausalLM.from_pretrained(path, dtype="bfloat16", quantization_config=config),
            torch.randint(1, 32000, (4, 128), generator=torch.Generator().manual_seed(0)),
        ),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
