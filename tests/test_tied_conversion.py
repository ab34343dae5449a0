"""Tied embeddings stay tied through a conversion that makes new parameters (what moving to an XLA device
does: each module gets its own copy, and the two would train apart). Forced here on the CPU with
PyTorch's switch for that behaviour."""

from __future__ import annotations

import torch

from staticformers import AutoConfig, AutoModelForCausalLM


def test_tied_weights_survive_a_conversion_that_replaces_parameters():
    cfg = AutoConfig.for_model(
        "qwen3",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=True,
    )
    model = AutoModelForCausalLM.from_config(cfg, seed=0)
    old = model.model.embed_tokens.weight
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        model.double()
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)
    assert model.model.embed_tokens.weight is not old  # the conversion did replace the parameter
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.dtype == torch.float64
