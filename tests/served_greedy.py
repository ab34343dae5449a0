"""One served completion against the model's own greedy tokens: a model is served (eager, 2 rows) and the
`openai` client's greedy completion of a prompt must be the text of `generate()`'s greedy tokens, cut at EOS.
The families' and int8's serving tests share it."""

from __future__ import annotations

import torch

from staticformers import CompileConfig


def assert_served_completion_is_greedy(model, tok, folder: str, text: str, max_tokens: int, **options) -> None:
    """`options`: more of the server's `ServeOptions` (chunked prefill, speculation, ...)."""
    import openai

    from staticformers.serving.server import (
        ServeOptions,
        Server,
        build_loop,
        build_state,
    )

    opts = ServeOptions(model=folder, served_model_name="tiny", backend="eager", max_batch_size=2, **options)
    server = Server(build_state(model, tok, build_loop(model, opts), opts), grace=2.0)
    server.start()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60.0, max_retries=0)
        ids = tok(text)["input_ids"]
        reply = client.completions.create(model="tiny", prompt=ids, max_tokens=max_tokens, temperature=0)
        want = model.generate(
            torch.tensor([ids]),
            max_new_tokens=max_tokens,
            do_sample=False,
            compile_config=CompileConfig(backend="eager"),
        )[0, len(ids) :].tolist()
        if tok.eos_token_id in want:
            want = want[: want.index(tok.eos_token_id)]
        assert reply.choices[0].text == tok.decode(want)
    finally:
        server.stop()
