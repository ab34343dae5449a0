"""What several commands check the same way before they load anything: a `--backend` name."""

from __future__ import annotations

from typing import Optional


def check_backend(name: Optional[str]) -> None:
    """Refuse a `--backend` that torch.compile does not know, before the model loads or anything prints."""
    if name is None:
        return
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    if name == "neuron" or name in known:  # "neuron" registers itself when torch-neuronx loads with the device
        return
    common = [b for b in ("inductor", "aot_eager", "eager", "cudagraphs") if b in known]
    raise ValueError(f"--backend {name!r} is not a torch.compile backend here: use {', '.join(common)} "
                     f"(or leave it out for the device's own).")


__all__ = ["check_backend"]
