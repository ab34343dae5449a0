"""Checks the family test files share (test_gpt_oss.py, test_deepseek.py, test_qwen3_5.py, test_family_features.py,
test_on_device.py): transformers' model of a tiny checkpoint, a left-padded batch, bf16 logits against
transformers', the checkpoint round trip, chunked prefill with prefix caching against transformers' greedy tokens,
and transformers' losses trained as the Trainer trains."""

from __future__ import annotations

import json
import os

import torch

import tolerances as tol


def hf_model(path, dtype=torch.float32):
    """transformers' model of the checkpoint at `path`, in eval mode."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def padded_batch(seq: int, pads: tuple = (0, 4, 7), seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids `[len(pads), seq]` and a mask whose row i is left-padded by `pads[i]` positions."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (len(pads), seq), generator=g)
    mask = torch.ones(len(pads), seq, dtype=torch.long)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
    return ids, mask


def assert_bf16_logits_agree(path, ids: torch.Tensor, mask: torch.Tensor) -> None:
    """Ours and transformers in bf16 on a left-padded batch: `tolerances.assert_bf16_logits_agree` at the real
    positions."""
    from staticformers import AutoModelForCausalLM

    ours, ref = AutoModelForCausalLM.from_pretrained(path, dtype="bfloat16"), hf_model(path, torch.bfloat16)
    with torch.no_grad():
        a = ours(input_ids=ids, attention_mask=mask).logits.float()[mask.bool()]
        b = ref(input_ids=ids, attention_mask=mask).logits.float()[mask.bool()]
    tol.assert_bf16_logits_agree(a, b)


def reference_losses(path: str, batch: dict, steps: int, lr: float, device: torch.device) -> list[float]:
    """transformers' model trained in float32 on the same batch with the same AdamW, clipping and constant
    learning rate as the Trainer: the loss before each step."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    labels = batch["labels"].to(device)
    ids, mask = batch["input_ids"].to(device), (labels != -100).long()
    items = (labels[:, 1:] != -100).sum()
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=items).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def assert_saved_as_loaded(path, tmp_path, ids: torch.Tensor, mask: torch.Tensor) -> dict:
    """Ours saves the checkpoint at `path` back bit-equal (the file's names and tensors), and transformers loads
    the save with our logits at the real positions. Returns `(saved config.json, original config.json)`."""
    from safetensors import safe_open

    from staticformers import AutoModelForCausalLM

    ours = AutoModelForCausalLM.from_pretrained(path)
    ours.save_pretrained(tmp_path)
    with (
        safe_open(os.path.join(path, "model.safetensors"), "pt") as a,
        safe_open(os.path.join(tmp_path, "model.safetensors"), "pt") as b,
    ):
        assert set(a.keys()) == set(b.keys())
        for name in a.keys():
            assert torch.equal(a.get_tensor(name), b.get_tensor(name)), name
    with torch.no_grad():
        want = ours(input_ids=ids, attention_mask=mask).logits[mask.bool()]
        tol.assert_close(hf_model(str(tmp_path))(input_ids=ids, attention_mask=mask).logits[mask.bool()], want)
    with open(os.path.join(tmp_path, "config.json")) as f, open(os.path.join(path, "config.json")) as g:
        return json.load(f), json.load(g)


def chunked_and_prefix_cached_run(path):
    """A long prompt prefilled in chunks of 16 through the extend step, then a second one whose first 40 tokens
    come from the prefix cache (blocks of 8), joining 12 steps later: each request's 8 tokens equal transformers'
    greedy tokens, chunks ran and the 40 tokens were hits. Returns the loop."""
    from loop_driver import run_loop
    from staticformers import AutoModelForCausalLM, CompileConfig, ShapePlan
    from staticformers.generation.engines import compile_settings, engine_for
    from staticformers.generation.generation_config import GenerationConfig
    from staticformers.generation.loop import GenerationLoop, GenerationRequest

    model, ref = AutoModelForCausalLM.from_pretrained(path), hf_model(path)
    engine = engine_for(
        model,
        ShapePlan(
            batch_sizes=[1, 2], prompt_lengths=[16, 32], kv_lengths=[128], max_model_len=128, extend_widths=((16, 1),)
        ),
    )
    settings = compile_settings(model, GenerationConfig(), CompileConfig(backend="eager"))
    g = torch.Generator().manual_seed(6)
    shared = torch.randint(3, 128, (40,), generator=g).tolist()
    long, second = shared + torch.randint(3, 128, (30,), generator=g).tolist(), shared + [5, 9, 11]

    def want(prompt):
        ids = torch.tensor([prompt])
        return ref.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)[
            0, len(prompt) :
        ].tolist()

    loop = GenerationLoop(engine, settings, chunked_prefill=16, prefix_caching=True, prefix_block_size=8)
    out = run_loop(
        loop,
        {0: [GenerationRequest(long, 8, request_id="long")], 12: [GenerationRequest(second, 8, request_id="second")]},
    )
    assert loop.chunks > 0 and loop.prefix.hits >= 40  # the shared 40 tokens came from the cache
    assert out["long"] == want(long) and out["second"] == want(second)
    return loop


__all__ = [
    "hf_model",
    "padded_batch",
    "assert_bf16_logits_agree",
    "reference_losses",
    "assert_saved_as_loaded",
    "chunked_and_prefix_cached_run",
]
