"""LoRA against peft, both ways, for one tiny family: peft's adapter loaded here gives peft's logits (and moves
them), and ours, saved, loads in peft with our logits. What the family tests share (test_gpt_oss.py,
test_deepseek.py, test_qwen3_5.py, test_family_features.py)."""

from __future__ import annotations

from typing import Optional

import pytest
import torch

import tolerances as tol


def assert_lora_equals_peft_both_ways(
    path: str, family: str, targets: list, tmp_path, ids: torch.Tensor, mask: Optional[torch.Tensor] = None
) -> None:
    """`path`: the family's tiny checkpoint (tests/tiny.py `family`); `ids` (and a left-padding `mask`, whose real
    positions are compared) the inputs."""
    peft = pytest.importorskip("peft")
    import transformers

    from staticformers import AutoModelForCausalLM, LoraConfig
    from tiny import build_hf_model

    kw = {"input_ids": ids} if mask is None else {"input_ids": ids, "attention_mask": mask}

    def logits(model):
        out = model(**kw).logits
        return out if mask is None else out[mask.bool()]

    torch.manual_seed(1)
    pm = peft.get_peft_model(
        build_hf_model(family),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, lora_dropout=0.0),
    ).eval()
    pm.save_pretrained(str(tmp_path / "peft"))
    ours = AutoModelForCausalLM.from_pretrained(path)
    ours.load_adapter(tmp_path / "peft")
    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = logits(pm)
        tol.assert_close(logits(ours), want)
        assert (want - logits(base)).abs().max() > 1e-2  # the adapter moves the logits
    mine = AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(2)
    mine.add_adapter(LoraConfig(r=4, lora_alpha=16, target_modules=targets, init_lora_weights=False))
    mine.save_pretrained(tmp_path / "ours")
    back = peft.PeftModel.from_pretrained(build_hf_model(family), str(tmp_path / "ours")).eval()
    with torch.no_grad():
        tol.assert_close(back(input_ids=ids).logits, mine(input_ids=ids).logits)


__all__ = ["assert_lora_equals_peft_both_ways"]
