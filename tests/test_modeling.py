"""Logit, loss and save/load parity with transformers for every family (tiny random models)."""

from __future__ import annotations

import pytest
import torch

from staticformers import AutoModelForCausalLM
from tiny import FAMILIES
import tolerances as tol

ALL = list(FAMILIES)


def _inputs(batch=3, seq=12, vocab=128, left_pad=True, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    if left_pad:
        mask[1, :4] = 0
        mask[2, :7] = 0
    return ids, mask


def _hf(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM as HF

    return HF.from_pretrained(path, dtype=dtype).eval()


@pytest.mark.parametrize("family", ALL)
def test_fp32_logits_match_transformers(family, tiny_checkpoints):
    path = tiny_checkpoints(family)
    ours, ref = AutoModelForCausalLM.from_pretrained(path), _hf(path)
    ids, mask = _inputs()
    with torch.no_grad():
        a = ours(input_ids=ids, attention_mask=mask).logits
        b = ref(input_ids=ids, attention_mask=mask).logits
        c = ours(input_ids=ids[:1]).logits  # no mask: the plain causal path
        d = ref(input_ids=ids[:1]).logits
    valid = mask.bool()
    tol.assert_close(a[valid], b[valid])
    tol.assert_close(c, d)


def test_sliding_window_is_applied(tiny_checkpoints):
    """mistral-window has a window of 5 over 12 tokens: the last logits must differ from full attention."""
    windowed = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("mistral-window"))
    full = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("mistral-window"))
    full.config.sliding_window = None
    for layer in full.model.layers:
        layer.self_attn.window = None
    full.model.windows = {None}
    ids, _ = _inputs(batch=1, left_pad=False)
    with torch.no_grad():
        assert not torch.allclose(windowed(input_ids=ids).logits[0, -1], full(input_ids=ids).logits[0, -1])
        torch.testing.assert_close(windowed(input_ids=ids).logits[0, :5], full(input_ids=ids).logits[0, :5])


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2", "mistral"])
def test_bf16_logits_close(family, tiny_checkpoints):
    path = tiny_checkpoints(family)
    ours = AutoModelForCausalLM.from_pretrained(path, dtype="bfloat16")
    ref = _hf(path, torch.bfloat16)
    assert ours.dtype == torch.bfloat16
    ids, mask = _inputs()
    with torch.no_grad():
        a = ours(input_ids=ids, attention_mask=mask).logits.float()
        b = ref(input_ids=ids, attention_mask=mask).logits.float()
    valid = mask.bool()
    torch.testing.assert_close(a[valid], b[valid], rtol=0.02, atol=0.02)


@pytest.mark.parametrize("family", ["qwen3", "llama-tied", "qwen2", "mistral", "gemma2", "gemma3", "olmo2"])
def test_loss_matches_transformers(family, tiny_checkpoints):
    path = tiny_checkpoints(family)
    ours, ref = AutoModelForCausalLM.from_pretrained(path), _hf(path)
    ids, mask = _inputs()
    mask = mask.flip(
        1
    )  # right padding, as training batches are (a left-pad row's first label is predicted from padding)
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        a = ours(input_ids=ids, attention_mask=mask, labels=labels).loss
        b = ref(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert float(a) == pytest.approx(float(b), rel=tol.FP32_REORDERED)  # a loss near ln(128) = 4.85


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "olmo2"])
def test_loss_gradients_match_transformers(tiny_checkpoints, family):
    path = tiny_checkpoints(family)
    ours, ref = AutoModelForCausalLM.from_pretrained(path), _hf(path)
    ids, _ = _inputs(left_pad=False)
    ours(input_ids=ids, labels=ids).loss.backward()
    ref(input_ids=ids, labels=ids).loss.backward()
    g_ours = dict(ours.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(g_ours[name].grad, p.grad, rtol=1e-4, atol=1e-6)


def test_packed_rows_equal_separate_documents(tiny_checkpoints):
    """position_ids restarting at 0 without an attention mask: documents do not see each other."""
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("llama"))
    g = torch.Generator().manual_seed(3)
    doc_a, doc_b = torch.randint(0, 128, (1, 5), generator=g), torch.randint(0, 128, (1, 7), generator=g)
    packed = torch.cat([doc_a, doc_b], 1)
    pos = torch.cat([torch.arange(5), torch.arange(7)]).unsqueeze(0)
    with torch.no_grad():
        together = model(input_ids=packed, position_ids=pos).logits
        apart = torch.cat([model(input_ids=doc_a).logits, model(input_ids=doc_b).logits], 1)
    tol.assert_close(together, apart)


def test_logits_to_keep(tiny_checkpoints):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3"))
    ids, _ = _inputs(left_pad=False)
    with torch.no_grad():
        full = model(input_ids=ids).logits
        last = model(input_ids=ids, logits_to_keep=1).logits
        picked = model(input_ids=ids, logits_to_keep=torch.tensor([0, 5])).logits
    assert last.shape == (3, 1, 128)
    torch.testing.assert_close(last[:, 0], full[:, -1])
    torch.testing.assert_close(picked, full[:, [0, 5]])


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "mistral-window"])
def test_kept_positions_skip_the_last_layer_elsewhere_and_match_transformers(family, tiny_checkpoints):
    """`logits_to_keep=n`: the last layer computes its output at those n positions only (keys and values
    at all of them), with and without padding and windows; logits and gradients unchanged. A forward
    hook on that layer sees every position, as with transformers."""
    path = tiny_checkpoints(family)
    ours, ref = AutoModelForCausalLM.from_pretrained(path), _hf(path)
    ids, mask = _inputs()
    seen = []
    mlp = ours.model.layers[-1].mlp
    mlp_forward = mlp.forward
    mlp.forward = lambda x, how=None: seen.append(x.shape[1]) or mlp_forward(x, how)  # not a hook: watched
    with torch.no_grad():
        for keep in (1, 3):
            for kwargs in ({"attention_mask": mask}, {}):
                a = ours(input_ids=ids, logits_to_keep=keep, **kwargs).logits
                b = ref(input_ids=ids, logits_to_keep=keep, **kwargs).logits
                rows = mask[:, -keep:].bool() if kwargs else torch.ones(3, keep, dtype=torch.bool)
                tol.assert_close(a[rows], b[rows])
    assert seen == [1, 1, 3, 3]
    hooked = []
    handle = mlp.register_forward_hook(lambda m, args, out: hooked.append(args[0].shape[1]))
    with torch.no_grad():
        hooked_logits = ours(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits
    handle.remove()
    assert hooked == [12]
    torch.testing.assert_close(hooked_logits, ours(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits)
    full = ours(input_ids=ids, attention_mask=mask)
    kept = ours(input_ids=ids, attention_mask=mask, logits_to_keep=2)
    grads = [
        torch.autograd.grad(out.logits[:, -2:].square().sum(), ours.model.layers[0].mlp.up_proj.weight)[0]
        for out in (full, kept)
    ]
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)


def test_output_access_like_transformers(tiny_checkpoints):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints("qwen3"))
    ids, _ = _inputs(left_pad=False)
    out = model(input_ids=ids, labels=ids)
    assert out["logits"] is out.logits and out[0] is out.loss and out.logits.shape == (3, 12, 128)


def test_from_config_init_and_tying():
    from staticformers import AutoConfig

    cfg = AutoConfig.for_model(
        "qwen3",
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
    )
    model = AutoModelForCausalLM.from_config(cfg, seed=0)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.num_parameters() == cfg.num_parameters
    std = model.model.layers[0].mlp.up_proj.weight.std().item()
    assert 0.015 < std < 0.025
    assert torch.equal(model.model.norm.weight, torch.ones(64))
