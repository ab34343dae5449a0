"""bench/kv_capacity.py's pure parts (the capacity workload of `bench/serve.py`): the long-tail lengths, the KV
budget as the library computes it, and what the `/metrics` samples say; no server is started."""

from __future__ import annotations

import os
import random
import statistics
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import kv_capacity  # noqa: E402
import reference  # noqa: E402

METRICS_TEXT = """\
# HELP staticformers:num_requests_running Requests holding a decode slot.
# TYPE staticformers:num_requests_running gauge
staticformers:num_requests_running{model_name="ref"} 5.0
staticformers:num_requests_waiting{model_name="ref"} 11.0
staticformers:kv_cache_usage_perc{model_name="ref"} 0.9375
# TYPE staticformers:num_preemptions_total counter
staticformers:num_preemptions_total{model_name="ref"} 3.0
staticformers:num_preemptions_created{model_name="ref"} 1.7e+09
staticformers:graphs_compiled_total{model_name="ref"} 2.0
staticformers:graphs_compiled_total{model_name="other"} 1.0
staticformers:num_requests_running_extra{model_name="ref"} 99.0
"""


def test_long_tail_lengths_are_seeded_clipped_and_mostly_short():
    lengths = kv_capacity.long_tail_lengths(4000, 16, 1800, 96.0, 1.2, random.Random(0))
    assert lengths == kv_capacity.long_tail_lengths(4000, 16, 1800, 96.0, 1.2, random.Random(0))
    assert min(lengths) == 16 and max(lengths) == 1800  # both bounds are hit, nothing beyond
    assert 80 <= statistics.median(lengths) <= 115  # most short
    assert 20 <= sum(n > 1000 for n in lengths) <= 200  # a few long
    with pytest.raises(ValueError, match="length bounds"):
        kv_capacity.long_tail_lengths(1, 20, 10, 96.0, 1.2, random.Random(0))


def test_capacity_jobs_fit_the_model_length_and_follow_the_seed():
    args = (50, 32000, 7, (16, 1800, 96.0, 1.2), (16, 128), 2048)
    jobs = kv_capacity.capacity_jobs(*args)
    assert jobs == kv_capacity.capacity_jobs(*args) != kv_capacity.capacity_jobs(50, 32000, 8, *args[3:])
    assert all(16 <= len(p) <= 1800 and 16 <= n <= 128 and len(p) + n <= 2048 for p, n in jobs)
    assert all(1 <= t < 32000 for p, _ in jobs for t in p)
    tight = kv_capacity.capacity_jobs(20, 100, 0, (16, 250, 200.0, 0.1), (16, 128), 256)
    assert all(len(p) + n <= 256 for p, n in tight)  # answers cut to fit
    with pytest.raises(ValueError, match="do not fit --max-model-len 2048"):
        kv_capacity.capacity_jobs(1, 100, 0, (16, 2048, 96.0, 1.2), (16, 128), 2048)
    summary = kv_capacity.length_summary(jobs)
    assert summary["prompt_max"] == max(len(p) for p, _ in jobs) and summary["output_tokens"] == sum(n for _, n in jobs)


def test_the_budget_is_an_eighth_of_16_static_rows_two_rows_and_127_blocks():
    from staticformers import CausalLM
    from staticformers.models.kv_cache import KVCache

    config = reference.reference_config("41m")
    budget = kv_capacity.kv_budget(config, torch.float32, 16, 2048, 8, 32)
    per_position = 8 * 4 * 64 * 2 * 4  # layers x KV heads x head_dim x (keys, values) x float32 bytes
    assert budget["bytes_per_position"] == per_position
    assert budget["bytes"] == 16 * 2048 * per_position // 8 == 2 * 2048 * per_position == 64 * 2**20
    assert budget["static_rows"] == 2
    assert budget["blocks"] == 2 * 2048 // 32 - 1  # the pool's null block counted against it
    with torch.device("meta"):
        model = CausalLM(config)
    assert budget["bytes"] == KVCache.bytes_for(model, 16, 2048) // 8
    assert kv_capacity.kv_budget(config, torch.bfloat16, 16, 2048, 8, 32)["bytes"] == budget["bytes"] // 2
    with pytest.raises(ValueError, match="holds no static row"):
        kv_capacity.kv_budget(config, torch.float32, 16, 2048, 32, 32)
    slots, extra = kv_capacity.server_flags(budget, 16)["blocks"]
    assert slots == 16 and extra == ["--kv-cache-memory-bytes", str(64 * 2**20), "--block-size", "32"]
    assert kv_capacity.server_flags(budget, 16)["static"] == (2, ["--enable-chunked-prefill"])
    assert kv_capacity.served_dtype("--threads 2 --dtype bfloat16") == "bfloat16"
    assert kv_capacity.served_dtype("--dtype=float16") == "float16" and kv_capacity.served_dtype("") is None


def test_metrics_samples_summarise_running_usage_and_preemptions():
    parsed = kv_capacity.parse_metrics(METRICS_TEXT)
    assert parsed == {
        "num_requests_running": 5.0,
        "num_requests_waiting": 11.0,
        "kv_cache_usage_perc": 0.9375,
        "num_preemptions_total": 3.0,
        "graphs_compiled_total": 3.0,
    }
    assert kv_capacity.parse_metrics("# nothing here\n") == {}
    samples = [
        {"num_requests_running": r, "num_requests_waiting": w, "kv_cache_usage_perc": u}
        for r, w, u in [(0, 0, 0.0), (4, 12, 0.5), (16, 0, 0.99), (8, 0, 0.25)]
    ]
    before = {"num_preemptions_total": 2.0, "graphs_compiled_total": 5.0}
    after = {"num_preemptions_total": 9.0, "graphs_compiled_total": 5.0}
    s = kv_capacity.sample_summary(samples, before, after)
    assert s == {
        "samples": 4,
        "running_max": 16,
        "running_mean": 7.0,
        "running_p50": 6.0,
        "waiting_max": 12,
        "waiting_mean": 3.0,
        "kv_cache_usage_peak": 0.99,
        "preemptions": 7,
        "graphs_compiled": 0,
    }
    empty = kv_capacity.sample_summary([], {}, {})
    assert empty["running_max"] is None and empty["preemptions"] is None


def test_ratios_are_medians_of_each_rounds_blocks_over_static():
    rounds = [
        {
            "static": {"running_max": 2, "running_mean": 2.0, "output_tokens_per_s": 100.0},
            "blocks": {"running_max": 16, "running_mean": 10.0, "output_tokens_per_s": 300.0},
        },
        {
            "static": {"running_max": 2, "running_mean": 1.0, "output_tokens_per_s": 100.0},
            "blocks": {"running_max": 12, "running_mean": 9.0, "output_tokens_per_s": 200.0},
        },
        {
            "static": {"running_max": 2, "running_mean": 2.0, "output_tokens_per_s": 200.0},
            "blocks": {"running_max": 14, "running_mean": 8.0, "output_tokens_per_s": 200.0},
        },
    ]
    assert kv_capacity.ratios(rounds) == {
        "running_max_blocks_over_static": 7.0,
        "running_mean_blocks_over_static": 5.0,
        "output_tokens_per_s_blocks_over_static": 2.0,
    }
    assert kv_capacity.medians([r["blocks"] for r in rounds]) == {
        "running_max": 14,
        "running_mean": 9.0,
        "output_tokens_per_s": 200.0,
    }
