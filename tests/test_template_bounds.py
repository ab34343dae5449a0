"""Hostile chat templates (they come from Hub repositories) are stopped within bounds of time and size,
each with one sentence, and ordinary templates render as before."""

from __future__ import annotations

import time

import pytest

from staticformers.tokenization import template_bounds
from staticformers.tokenization.chat_template import render
from staticformers.tokenization.template_bounds import TemplateLimitError

CHAT = [[{"role": "user", "content": "hi"}]]


@pytest.mark.parametrize(
    "template,message",
    [
        (
            "{{ 'a' * 10**9 }}",
            r"^The chat template repeats a value of length 1 1000000000 times, more than the 16777216",
        ),
        ("{{ [1, 2] * 10**8 }}", r"^The chat template repeats a value of length 2 100000000 times"),
        ("{{ 10 ** 100000000 }}", r"^The chat template computes 10 \*\* 100000000, an integer of more than 4096 bits"),
        (
            "{% for i in range(1000) %}{{ 'x' * 100000 }}{% endfor %}",
            r"^The chat template made more than 16777216 characters",
        ),
        (
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            r"^The chat template ran for more than 0.3 s and was stopped",
        ),
        (
            "{% set r = range(100000) %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}",
            r"^The chat template ran for more than 0.3 s and was stopped",
        ),
        (
            "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}",
            r"^The chat template ran for more than 0.3 s and was stopped",
        ),
    ],
)
def test_a_hostile_template_is_stopped(monkeypatch, template, message):
    monkeypatch.setattr(template_bounds, "MAX_SECONDS", 0.3)
    start = time.monotonic()
    with pytest.raises(TemplateLimitError, match=message):
        render(template, CHAT)
    took = time.monotonic() - start
    # generous: the 0.3 s limit is checked as the template runs; only a limit that is not enforced reaches this
    assert took < 60, f"a template stopped at 0.3 s ran for {took:.1f} s: the limit is not enforced"


def test_ordinary_templates_still_render():
    template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content * 2 }}{% endfor %}"
        "{% for i in range(3) %}{{ i }}{% endfor %}{{ 2 ** 10 }}{{ '-' * 3 }}{{ range(5) | length }}"
    )
    assert render(template, CHAT) == ["<user>hihi0121024---5"]
