"""`lucedesk bench`: the report's arithmetic on a recorded run, and a real run against the
server on a tiny model."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lucedesk.bench.metrics import RequestRecord, percentile, summarize
from lucedesk.cli import build_parser
from lucedesk.engine.models.loader import load_model
from lucedesk.server import create_app, start_server
from tests.engine_harness import make_engine


def test_percentiles_interpolate():
    assert percentile([1, 2, 3, 4, 5], 50) == 3
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([10, 20], 90) == 19
    assert math.isnan(percentile([], 50))


def test_summary_arithmetic_on_a_recorded_run():
    # Three requests sent at t=0, 1, 2; token arrival times as recorded.
    records = [
        RequestRecord(0.0, [0.5, 0.6, 0.7, 0.8], 10, 4, 4),  # TTFT .5, TPOT .1
        RequestRecord(1.0, [1.2, 1.5, 1.8], 10, 3, 4),  # TTFT .2, TPOT .3, one short
        RequestRecord(2.0, [3.0, 3.1], 10, 2, 2),  # TTFT 1.0, TPOT .1
        RequestRecord(2.5, [], 10, 0, 4, error="HTTP 503"),
    ]
    s = summarize(records, duration_s=4.0, slo_ttft=0.6, slo_tpot=0.2)
    assert (s.num_requests, s.num_failed) == (4, 1)
    assert s.output_tokens == 9 and s.prompt_tokens == 30
    assert s.output_tok_s == pytest.approx(9 / 4) and s.requests_s == pytest.approx(3 / 4)
    assert s.ttft_p50 == pytest.approx(0.5) and s.ttft_p90 == pytest.approx(0.9)
    assert s.tpot_p50 == pytest.approx(0.1)
    # ITLs: .1 .1 .1 | .3 .3 | .1 -> the largest gap is .3
    assert s.max_itl == pytest.approx(0.3) and s.itl_p50 == pytest.approx(0.1)
    # Goodput: only the first meets TTFT <= .6 and TPOT <= .2.
    assert s.goodput_requests_s == pytest.approx(1 / 4)
    assert s.length_mismatches == 1


@pytest.fixture(scope="module")
def server(tiny_llama):
    engine = make_engine(
        load_model(tiny_llama, torch.float32), max_slots=4, kv_pool_tokens=4096, max_model_len=1024
    ).start()
    running = start_server(create_app(engine, model_name="tiny"), "127.0.0.1", 0)
    yield running
    running.stop()
    engine.shutdown()


def test_bench_against_a_running_server(server, tmp_path, capsys):
    from lucedesk.commands import bench

    out = tmp_path / "run.json"
    png = tmp_path / "plot.png"
    args = build_parser().parse_args(
        [
            "bench",
            "--base-url",
            server.url,
            "-n",
            "6",
            "-c",
            "1,3",
            "--request-rate",
            "20",
            "--input-len",
            "12",
            "--output-len",
            "9",
            "--warmup",
            "1",
            "--slo-ttft",
            "5",
            "--json",
            str(out),
            "--plot",
            str(png),
        ]
    )
    assert bench(args) == 0
    result = json.loads(out.read_text())
    assert result["model"] == "tiny" and len(result["levels"]) == 3
    for level in result["levels"]:
        assert level["num_failed"] == 0 and level["length_mismatches"] == 0
        assert level["output_tokens"] == 6 * 9
        assert level["goodput_requests_s"] is not None
    assert png.read_bytes()[:4] == b"\x89PNG"
    table = capsys.readouterr().out
    rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| C=")]
    rows += [line.split("|")[1:-1] for line in table.splitlines() if " req/s |" in line[:14]]
    # One row a level, in order, each showing that level's own numbers.
    assert [r[0].strip() for r in rows] == ["C=1", "C=3", "20 req/s"]
    for row, level in zip(rows, result["levels"]):
        cells = [c.strip() for c in row]
        assert cells[1] == f"{level['output_tok_s']:.1f}"
        assert cells[2] == f"{level['requests_s']:.2f}"
        assert cells[-2:] == ["0", "0"]  # failed, short


def test_bench_compare_prints_ratios(server, capsys):
    from lucedesk.commands import bench

    args = build_parser().parse_args(
        [
            "bench",
            "--compare",
            server.url,
            server.url,
            "-n",
            "3",
            "-c",
            "2",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--warmup",
            "0",
            "--dataset",
            "shared-prefix",
            "--prefix-len",
            "6",
        ]
    )
    assert bench(args) == 0
    assert "ratios against" in capsys.readouterr().out


def test_bench_needs_a_target():
    from lucedesk.commands import bench
    from lucedesk.errors import ConfigError

    with pytest.raises(ConfigError, match="--base-url"):
        bench(build_parser().parse_args(["bench"]))


def test_bench_mixed_lengths(server, tmp_path):
    from lucedesk.commands import bench

    out = tmp_path / "mixed.json"
    args = build_parser().parse_args(
        [
            "bench",
            "--base-url",
            server.url,
            "-n",
            "8",
            "-c",
            "4",
            "--input-len",
            "4:40",
            "--output-len",
            "2:12",
            "--warmup",
            "0",
            "--json",
            str(out),
        ]
    )
    assert bench(args) == 0
    level = json.loads(out.read_text())["levels"][0]
    assert level["num_failed"] == 0 and level["length_mismatches"] == 0
    assert 8 * 2 <= level["output_tokens"] <= 8 * 12 and level["output_tokens"] != 8 * 12


def test_offline_bench_from_the_command_line(tiny_llama, tmp_path, capsys):
    """`lucedesk bench --offline` end to end on the in-process engine, lengths as N or
    MIN:MAX; every request runs to its length and the JSON records each level."""
    from lucedesk.commands import bench

    out = tmp_path / "offline.json"
    args = build_parser().parse_args(
        [
            "bench",
            "--offline",
            "--model",
            str(tiny_llama),
            "-n",
            "6",
            "-c",
            "1,3",
            "--input-len",
            "8:40",
            "--output-len",
            "5",
            "--set",
            "max_slots=4",
            "--json",
            str(out),
        ]
    )
    assert bench(args) == 0
    assert "| 3 |" in capsys.readouterr().out
    levels = json.loads(out.read_text())["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 3]
    for lv in levels:
        assert lv["num_requests"] == 6 and lv["num_failed"] == 0
        assert lv["output_tokens"] == 6 * 5 and lv["length_mismatches"] == 0


def test_offline_bench_rejects_bad_lengths_before_loading():
    from lucedesk.commands import bench
    from lucedesk.errors import ConfigError

    args = build_parser().parse_args(["bench", "--offline", "--input-len", "0", "-c", "1"])
    with pytest.raises(ConfigError, match="length '0'"):
        bench(args)
