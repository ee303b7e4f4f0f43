"""Load parsing and the /v1/loads probe verdicts, without sockets."""

from __future__ import annotations

from collections import Counter

import msgspec
import pytest

from router.loads import (
    MAX_DP_SIZE,
    MAX_METRIC_SAMPLE_BYTES,
    MAX_METRIC_SAMPLES,
    MAX_REPORTED,
    METRICS_MAX_BODY_BYTES,
    EngineLoad,
    LoadsProbe,
    ProbeOutcome,
    TooManySamples,
    classify_loads_response,
    parse_loads_body,
    parse_metrics_text,
)

# smg's mock_worker body, plus a second rank: the minimal real-world fixture.
SMG_BODY = msgspec.json.encode(
    {
        "timestamp": "",
        "dp_rank_count": 2,
        "loads": [
            {"dp_rank": 0, "num_running_reqs": 3, "num_waiting_reqs": 5, "token_usage": 0.25},
            {"dp_rank": 1, "num_running_reqs": 0, "num_waiting_reqs": 0, "token_usage": 0.0},
        ],
    }
)


# --- /v1/loads bodies -------------------------------------------------------------------------


def test_a_load_body_maps_each_rank_to_its_counts_and_usage() -> None:
    assert parse_loads_body(SMG_BODY) == {
        0: EngineLoad(running=3, waiting=5, kv_usage=0.25),
        1: EngineLoad(running=0, waiting=0, kv_usage=0.0),
    }


def test_sglang_bodies_without_dp_rank_count_and_with_extra_sections_parse() -> None:
    body = {
        "timestamp": "2026-01-01T00:00:00Z",
        "version": "0.5.23",
        "loads": [
            {
                "timestamp": "x",
                "dp_rank": 1,
                "num_running_reqs": 2,
                "num_waiting_reqs": 1,
                "token_usage": 0.5,
                "memory": {"kv_cache_gb": 4.0},
                "disaggregation": {"mode": "null"},
            }
        ],
    }
    assert parse_loads_body(msgspec.json.encode(body)) == {1: EngineLoad(2, 1, 0.5)}


def test_missing_or_mistyped_fields_are_unknown_not_zero() -> None:
    body = {"loads": [{"dp_rank": 0, "num_running_reqs": "3", "token_usage": -1}]}
    assert parse_loads_body(msgspec.json.encode(body)) == {0: EngineLoad(None, None, None)}
    body = {"loads": [{"dp_rank": 0, "num_running_reqs": True, "num_waiting_reqs": 2.0}]}
    assert parse_loads_body(msgspec.json.encode(body)) == {0: EngineLoad(None, 2, None)}


def test_an_entry_without_a_dp_rank_is_the_rank_at_its_position() -> None:
    body = {"loads": [{"num_running_reqs": 1}, {"num_running_reqs": 2}]}
    assert parse_loads_body(msgspec.json.encode(body)) == {
        0: EngineLoad(running=1),
        1: EngineLoad(running=2),
    }


@pytest.mark.parametrize(
    "body",
    [
        b"<html>not found</html>",
        b"",
        b"[]",
        b'{"status": "ok"}',
        b'{"loads": {"dp_rank": 0}}',
        b'{"loads": [1, 2]}',
    ],
)
def test_bodies_that_are_not_load_bodies_parse_to_none(body: bytes) -> None:
    assert parse_loads_body(body) is None


def test_an_empty_loads_array_is_an_empty_dict_not_none() -> None:
    assert parse_loads_body(b'{"loads": []}') == {}


# --- probe verdicts ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "body", "outcome"),
    [
        (200, SMG_BODY, ProbeOutcome.AVAILABLE),
        (404, None, ProbeOutcome.ABSENT),
        (405, None, ProbeOutcome.ABSENT),
        (501, None, ProbeOutcome.ABSENT),
        (200, b"<html></html>", ProbeOutcome.ABSENT),
        (200, b'{"loads": []}', ProbeOutcome.INCONCLUSIVE),
        (503, None, ProbeOutcome.INCONCLUSIVE),
        (500, None, ProbeOutcome.INCONCLUSIVE),
        (401, None, ProbeOutcome.INCONCLUSIVE),
        (403, None, ProbeOutcome.INCONCLUSIVE),
        (None, None, ProbeOutcome.INCONCLUSIVE),  # timeout or connection error
        (200, None, ProbeOutcome.INCONCLUSIVE),  # body too large to read
    ],
)
def test_each_response_maps_to_its_probe_outcome(
    status: int | None, body: bytes | None, outcome: ProbeOutcome
) -> None:
    assert classify_loads_response(status, body)[0] is outcome


def test_absent_latches_and_inconclusive_never_demotes() -> None:
    probe = LoadsProbe()
    for _ in range(10):
        assert probe.observe(503, None) == (ProbeOutcome.INCONCLUSIVE, None)
    assert probe.absent is False
    outcome, loads = probe.observe(200, SMG_BODY)
    assert outcome is ProbeOutcome.AVAILABLE
    assert loads is not None and loads[0] == EngineLoad(3, 5, 0.25)
    probe.observe(404, None)
    assert probe.absent is True


# --- /metrics text ----------------------------------------------------------------------------

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 99.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.125
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3",model_name="m"} 1.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="m"} 1.0
"""


def test_vllm_metrics_map_per_engine_label() -> None:
    assert parse_metrics_text(VLLM_METRICS) == {
        0: EngineLoad(running=3, waiting=4, kv_usage=0.5),
        1: EngineLoad(running=1, waiting=0, kv_usage=0.125),
    }


def test_the_old_vllm_usage_name_is_read_and_loses_to_the_new_one_when_both_exist() -> None:
    old = 'vllm:gpu_cache_usage_perc{model_name="m"} 0.75\n'
    assert parse_metrics_text(old) == {0: EngineLoad(kv_usage=0.75)}
    both = old + 'vllm:kv_cache_usage_perc{model_name="m"} 0.5\n'
    assert parse_metrics_text(both) == {0: EngineLoad(kv_usage=0.5)}


@pytest.mark.parametrize("prefix", ["sglang:", "sglang_"])
def test_sglang_metrics_read_with_either_prefix_per_dp_rank(prefix: str) -> None:
    text = (
        f"# TYPE {prefix}num_running_reqs gauge\n"
        f'{prefix}num_running_reqs{{model_name="m",dp_rank="0"}} 2.0\n'
        f'{prefix}num_running_reqs{{model_name="m",dp_rank="1"}} 6.0\n'
        f'{prefix}num_queue_reqs{{model_name="m",dp_rank="1"}} 3.0\n'
        f'{prefix}token_usage{{model_name="m",dp_rank="0"}} 0.9\n'
    )
    assert parse_metrics_text(text) == {
        0: EngineLoad(running=2, waiting=None, kv_usage=0.9),
        1: EngineLoad(running=6, waiting=3, kv_usage=None),
    }


def test_label_sets_of_one_rank_add_up_counts_and_take_the_max_usage() -> None:
    text = (
        'sglang_num_running_reqs{model_name="a"} 2\n'
        'sglang_num_running_reqs{model_name="b"} 3\n'
        'sglang_token_usage{model_name="a"} 0.25\n'
        'sglang_token_usage{model_name="b"} 0.5\n'
    )
    assert parse_metrics_text(text) == {0: EngineLoad(running=5, waiting=None, kv_usage=0.5)}


def test_a_metric_absent_leaves_its_field_unknown_and_no_metric_gives_no_rank() -> None:
    assert parse_metrics_text('vllm:num_requests_waiting{engine="0"} 1\n') == {
        0: EngineLoad(running=None, waiting=1, kv_usage=None)
    }
    unrelated = "# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 3\n"
    assert parse_metrics_text(unrelated) == {}
    assert parse_metrics_text("<html>garbage</html>") == {}


def test_nan_and_negative_gauges_are_unknown() -> None:
    text = 'vllm:num_requests_running{engine="0"} NaN\nvllm:num_requests_waiting{engine="0"} -1\n'
    assert parse_metrics_text(text) == {}


def test_a_broken_sample_line_of_a_gauge_we_read_raises_value_error() -> None:
    with pytest.raises(ValueError, match="unparseable"):
        parse_metrics_text('vllm:num_requests_running{engine="0"} lots\n')


# --- capacity ---------------------------------------------------------------------------------


def test_a_load_body_states_the_pool_in_max_total_num_tokens_and_zero_is_unknown() -> None:
    body = {
        "loads": [
            {"dp_rank": 0, "num_waiting_reqs": 1, "max_total_num_tokens": 65536},
            {"dp_rank": 1, "num_waiting_reqs": 1, "max_total_num_tokens": 0},
            {"dp_rank": 2, "num_waiting_reqs": 1, "max_total_num_tokens": "65536"},
        ]
    }
    assert parse_loads_body(msgspec.json.encode(body)) == {
        0: EngineLoad(waiting=1, capacity_tokens=65536),
        1: EngineLoad(waiting=1),
        2: EngineLoad(waiting=1),
    }


def test_a_load_body_states_the_slots_in_max_running_requests_and_zero_is_unknown() -> None:
    body = {
        "loads": [
            {"dp_rank": 0, "num_running_reqs": 2, "max_running_requests": 2},
            {"dp_rank": 1, "num_running_reqs": 0, "max_running_requests": 0},
            {"dp_rank": 2, "num_running_reqs": 1},
        ]
    }
    assert parse_loads_body(msgspec.json.encode(body)) == {
        0: EngineLoad(running=2, slots=2),
        1: EngineLoad(running=0),
        2: EngineLoad(running=1),
    }


def test_vllm_states_its_pool_in_the_labels_of_cache_config_info_per_engine() -> None:
    text = (
        "# HELP vllm:cache_config_info Information of the LLMEngine's cache_config\n"
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="16",cache_dtype="auto",num_cpu_blocks="None",'
        'num_gpu_blocks="573",engine="0"} 1.0\n'
        'vllm:cache_config_info{block_size="32",num_gpu_blocks="100",engine="1"} 1.0\n'
        'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0\n'
    )
    assert parse_metrics_text(text) == {
        0: EngineLoad(waiting=2, capacity_tokens=573 * 16),
        1: EngineLoad(capacity_tokens=3200),
    }


@pytest.mark.parametrize(
    "labels",
    [
        'block_size="16",num_gpu_blocks="None"',  # vLLM before it profiled its memory
        'num_gpu_blocks="573"',  # no block size: the tokens are unknowable
        'block_size="16",num_gpu_blocks="-5"',
        'block_size="16",num_gpu_blocks="0"',
    ],
)
def test_a_vllm_pool_that_is_not_stated_in_numbers_is_unknown(labels: str) -> None:
    text = f'vllm:cache_config_info{{{labels},engine="0"}} 1.0\n'
    text += 'vllm:num_requests_running{engine="0"} 1.0\n'
    assert parse_metrics_text(text) == {0: EngineLoad(running=1)}


@pytest.mark.parametrize("prefix", ["sglang:", "sglang_"])
def test_sglang_states_its_pool_as_a_gauge_with_either_prefix(prefix: str) -> None:
    text = (
        f'{prefix}max_total_num_tokens{{model_name="m",dp_rank="0"}} 2048.0\n'
        f'{prefix}max_total_num_tokens{{model_name="m",dp_rank="1"}} 0.0\n'
        f'{prefix}num_queue_reqs{{model_name="m",dp_rank="1"}} 3.0\n'
    )
    assert parse_metrics_text(text) == {
        0: EngineLoad(capacity_tokens=2048),
        1: EngineLoad(waiting=3),
    }


# --- bounds: what a worker states is believed up to MAX_REPORTED -------------------------------


def test_figures_above_the_bound_in_a_load_body_are_unknown_and_counted_by_field() -> None:
    huge = b"9" * 400
    body = (
        b'{"loads":[{"dp_rank":0,"num_running_reqs":1,"num_waiting_reqs":1e308,'
        b'"max_total_num_tokens":1e308,"max_running_requests":' + huge + b"},"
        b'{"dp_rank":1,"num_waiting_reqs":281474976710656,'  # 2**48: the bound itself
        b'"max_total_num_tokens":' + b"9" * 40 + b',"num_running_reqs":281474976710657}]}'
    )
    out_of_range: Counter[str] = Counter()
    assert parse_loads_body(body, out_of_range=out_of_range) == {
        0: EngineLoad(running=1),
        1: EngineLoad(waiting=MAX_REPORTED),
    }
    assert out_of_range == {"waiting": 1, "capacity": 2, "slots": 1, "running": 1}


def test_load_entries_of_ranks_past_the_dp_size_are_skipped() -> None:
    body = msgspec.json.encode(
        {"loads": [{"num_waiting_reqs": i} for i in range(2000)] + [{"dp_rank": 1}]}
    )
    assert parse_loads_body(body, ranks=2) == {0: EngineLoad(waiting=0), 1: EngineLoad()}
    assert len(parse_loads_body(body) or {}) == MAX_DP_SIZE


@pytest.mark.parametrize(
    ("text", "counted"),
    [
        # A pool stated in labels too long for a float (int * int overflowed it).
        (
            'vllm:cache_config_info{block_size="16",num_gpu_blocks="' + "9" * 400 + '"} 1.0\n',
            {"capacity": 1},
        ),
        # One gauge twice at 1e308 (summed, inf, which round() refused): each sample.
        (
            'vllm:num_requests_waiting{model_name="a"} 1e308\n'
            'vllm:num_requests_waiting{model_name="b"} 1e308\n',
            {"waiting": 2},
        ),
        ('sglang:max_total_num_tokens{dp_rank="0"} 1e308\n', {"capacity": 1}),
        # Each below the bound, the sum past it.
        (
            'vllm:num_requests_waiting{model_name="a"} 2e14\n'
            'vllm:num_requests_waiting{model_name="b"} 2e14\n',
            {"waiting": 1},
        ),
    ],
)
def test_metrics_figures_above_the_bound_are_unknown_and_counted_not_raised(
    text: str, counted: dict[str, int]
) -> None:
    out_of_range: Counter[str] = Counter()
    text += 'vllm:num_requests_running{engine="0"} 1.0\n'
    assert parse_metrics_text(text, out_of_range=out_of_range) == {0: EngineLoad(running=1)}
    assert out_of_range == counted


def test_metrics_with_more_load_gauge_lines_than_the_bound_fail_before_parsing() -> None:
    line = 'vllm:num_requests_waiting{{engine="0",model_name="m{}"}} 0\n'
    text = "".join(map(line.format, range(MAX_METRIC_SAMPLES)))
    assert parse_metrics_text(text) == {0: EngineLoad(waiting=0)}
    with pytest.raises(TooManySamples, match="too many samples"):
        parse_metrics_text(text + line.format("last"))


def test_metrics_with_more_load_gauge_bytes_than_the_bound_fail_before_parsing() -> None:
    # 900 lines of 250 labels: within the line bound, and each line read cost the loop ~4 ms.
    many = ",".join(f'l{j}="v"' for j in range(250))
    line = 'vllm:num_requests_running{{engine="0",{},m="{}"}} 1\n'
    text = "".join(line.format(many, i) for i in range(900))
    assert len(text) < METRICS_MAX_BODY_BYTES
    with pytest.raises(TooManySamples, match="bytes of load gauge lines"):
        parse_metrics_text(text)
    within = "".join(
        line.format(many, i) for i in range(MAX_METRIC_SAMPLE_BYTES // len(line.format(many, 999)))
    )
    assert parse_metrics_text(within) == {0: EngineLoad(running=len(within.splitlines()))}


@pytest.mark.parametrize(
    ("line", "rank"),
    [
        # A value spelling another label, quotes and braces escaped: read as one value.
        ('vllm:num_requests_running{model_name="a,engine=\\"7\\"} x",engine="1"} 3', 1),
        ('vllm:num_requests_running{model_name="a\\\\",engine="1",} 3', 1),
        ('vllm:num_requests_running{ engine = "1" , model_name="m\\nn" } 3 1700000000000', 1),
        ('vllm:num_requests_running{model_name="engine=\\"1\\""} 3', 0),
        ("vllm:num_requests_running 3", 0),
        ("vllm:num_requests_running{} 3", 0),
        # Blanks between a name and its labels: the text format allows them between tokens.
        ('vllm:num_requests_running {engine="1"} 3', 1),
        ('vllm:num_requests_running\t {engine="1"} 3', 1),
    ],
)
def test_a_sample_line_is_read_label_by_label_as_prometheus_writes_them(
    line: str, rank: int
) -> None:
    assert parse_metrics_text(line + "\n") == {rank: EngineLoad(running=3)}


@pytest.mark.parametrize(
    "line",
    [
        'vllm:num_requests_running{engine="1" 3',
        'vllm:num_requests_running{engine="1} 3',
        "vllm:num_requests_running{engine=1} 3",
        'vllm:num_requests_running{engine="1"engine="2"} 3',
        'vllm:num_requests_running{engine="1"} 1_000',
        'vllm:num_requests_running{engine="1"}',
    ],
)
def test_a_sample_line_that_prometheus_would_refuse_is_unparseable(line: str) -> None:
    with pytest.raises(ValueError, match="unparseable"):
        parse_metrics_text(line + "\n")


def test_metrics_samples_of_ranks_past_the_dp_size_are_dropped() -> None:
    text = "".join(f'vllm:num_requests_waiting{{engine="{r}"}} {r}\n' for r in range(4))
    text += 'vllm:num_requests_waiting{engine="99999999999999999999999"} 5\n'
    assert parse_metrics_text(text, ranks=2) == {0: EngineLoad(waiting=0), 1: EngineLoad(waiting=1)}


def test_lines_of_gauges_not_read_are_skipped_however_many() -> None:
    bucket = 'vllm:e2e_request_latency_seconds_bucket{{engine="0",le="{}"}} 3\n'
    text = "".join(map(bucket.format, range(100_000)))
    assert len(text) > METRICS_MAX_BODY_BYTES  # more than a poll reads: no parse failure
    assert parse_metrics_text(text + 'vllm:num_requests_waiting{engine="0"} 2\n') == {
        0: EngineLoad(waiting=2)
    }
