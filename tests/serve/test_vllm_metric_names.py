"""`decodekit serve --vllm-metrics`: the same figures also under vLLM's metric names, labelled with `model_name`, so
a dashboard built for vLLM reads decodekit's /metrics unchanged."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from decodekit.recipe import load_recipe
from tests.helpers.batch_cases import write_tiny_recipe
from tests.helpers.served import Served


def _samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{url}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_vllm_names_report_what_decodekits_names_report(tmp_path):
    served = Served(load_recipe(write_tiny_recipe(tmp_path, max_tokens=5)), served_model_name="tiny",
                    vllm_metrics=True)
    try:
        client = served.client(api_key="unused")
        for prompt in ("one", "two three", "four five six"):
            client.completions.create(model="tiny", prompt=prompt, max_tokens=5, extra_body={"ignore_eos": True})
        served.wait_idle()
        got = _samples(served.url)
        label = (("model_name", "tiny"),)
        assert got[("vllm:prompt_tokens_total", label)] == got[("decodekit_prompt_tokens_total", ())] > 0
        assert got[("vllm:generation_tokens_total", label)] == got[("decodekit_generation_tokens_total", ())] == 15
        assert got[("vllm:request_success_total", (("finished_reason", "length"), ("model_name", "tiny")))] == 3
        assert got[("vllm:time_to_first_token_seconds_count", label)] == 3
        assert got[("vllm:e2e_request_latency_seconds_count", label)] == 3
        assert got[("vllm:num_requests_running", label)] == 0 and got[("vllm:num_requests_waiting", label)] == 0
        assert got[("vllm:kv_cache_usage_perc", label)] == 0.0
        assert ("vllm:num_preemptions_total", label) in got
    finally:
        served.stop()


def test_without_the_option_no_vllm_names_are_exported(tmp_path):
    served = Served(load_recipe(write_tiny_recipe(tmp_path, max_tokens=5)), served_model_name="tiny")
    try:
        assert not any(name.startswith("vllm:") for name, _ in _samples(served.url))
    finally:
        served.stop()
