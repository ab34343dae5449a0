"""Speculative decoding in the generation loop: a proposer guesses up to k tokens per row, the target
verifies them in one `[B, k+1]` extend step, and each row keeps what the target would have chosen.

api/speculative.py (the method and k, with transformers' and vLLM's names), prompt_lookup.py (n-gram proposals
from the row's own tokens, on the host), draft.py (a draft model's proposals, in its own engine and
decode graph), acceptance.py (greedy matching and the rejection rule, per row and position),
step.py (`Speculator`: the loop's verify plans).

May import what `generation` may; loop.py calls a `Speculator` it is given and never imports this package;
runner.py runs a verify step through acceptance.py.
"""
