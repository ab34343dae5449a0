"""The two PyTorch notices silenced for TP x FSDP2 runs are silenced by their exact text, nothing else.
(That the example prints no warning at all under torchrun is checked by tests/test_readme.py.)"""

import logging
import warnings

from staticformers.distributed.quiet import silence_pytorch_notices


def test_only_the_two_notices_are_silenced(caplog):
    silence_pytorch_notices()
    silence_pytorch_notices()  # once is enough; twice adds nothing
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        silence_pytorch_notices.__globals__["_installed"] = False
        silence_pytorch_notices()  # the filter goes in front of "always"
        warnings.warn(
            "FSDP2-wrapped module (FSDPCausalLM) returned a view tensor. An in-place op ...", UserWarning, stacklevel=1
        )
        warnings.warn("FSDP2-wrapped module (FSDPCausalLM) did something else", UserWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["FSDP2-wrapped module (FSDPCausalLM) did something else"]
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    with caplog.at_level(logging.WARNING, logger=logger.name):
        logger.warning(
            "While redistributing from (S, S) to (R, R), 2 sequential all_gather operations will be performed."
        )
        logger.warning("While redistributing, something else happened.")
    assert [r.getMessage() for r in caplog.records if r.name == logger.name] == [
        "While redistributing, something else happened."
    ]
