"""``skippyd bench`` through Typer's CliRunner against real ``skippyd serve`` processes.

The served model is the suite's tiny GGUF, so every run takes a second or two.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from skippyd.bench.command import app
from skippyd.bench.process import skippyd_process
from skippyd.bench.workload import IntRange, WorkloadSpec, build_level
from skippyd.exitcodes import ExitCode

runner = CliRunner()


def tiny_config(model_path, workdir) -> str:
    # NOTE: a control socket of its own, so it never meets another stage with the same id.
    return (f'[stage]\nmodel_path = "{model_path}"\n\n'
            "[runtime]\nctx_size = 1024\nlane_count = 4\nthreads = 1\nthreads_batch = 1\n\n"
            f'[control]\nsocket = "{workdir / "control.sock"}"\n\n'
            '[http]\nlisten = "127.0.0.1:0"\n')


def write_config(model_path, workdir):
    path = workdir / "stage.toml"
    path.write_text(tiny_config(model_path, workdir))
    return path


@pytest.fixture(scope="module")
def server_url(tiny_model_path, tmp_path_factory):
    config = write_config(tiny_model_path, tmp_path_factory.mktemp("bench-served"))
    with skippyd_process(str(config)) as server:
        yield server.url


@pytest.fixture
def config_path(tiny_model_path, tmp_path):
    return write_config(tiny_model_path, tmp_path)


def invoke(*args: str):
    return runner.invoke(app, list(args))


def test_url_report_counts_what_was_sent(server_url, tmp_path):
    out = tmp_path / "report.json"
    result = invoke("--url", server_url, "-c", "1,3", "-n", "5", "--prompt-tokens", "6:12",
                    "--output-tokens", "2:7", "--seed", "7", "--json", str(out), "--per-request")
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    (target,) = report["targets"]
    spec = WorkloadSpec(concurrency=(1, 3), num_requests=5, prompt_words=IntRange(6, 12),
                        output_tokens=IntRange(2, 7), seed=7)
    sent = [build_level(spec, i) for i in range(2)]
    assert target["num_requests"] == target["num_ok"] == 10
    assert target["output_tokens"] == sum(r.max_tokens for level in sent for r in level)
    for level, requests in zip(target["levels"], sent, strict=True):
        assert level["num_requests"] == level["num_ok"] == len(requests)
        assert level["output_tokens"] == sum(r.max_tokens for r in requests)
        assert level["prompt_tokens_source"] == "usage" and level["prompt_tokens"] > 0
        assert 0 <= level["cached_prompt_tokens"] <= level["prompt_tokens"]
        assert level["errors"] == {} and level["output_tok_s"] > 0
        assert level["latency_ms"]["p50"] <= level["latency_ms"]["max"]
    records = target["requests"]
    assert sorted((r["concurrency"], r["index"]) for r in records) == \
        [(c, i) for c in (1, 3) for i in range(5)]
    assert all(r["token_source"] == "usage" and r["num_output_tokens"] == r["max_tokens"]
               for r in records)
    assert "throughput" in result.stdout and "out tok/s" in result.stdout
    assert "output tok/s by concurrent streams" in result.stdout  # the sweep's chart
    assert "TTFT p50 (ms) by concurrent streams" in result.stdout


def test_vs_prints_and_writes_ratios(server_url, tmp_path):
    out = tmp_path / "vs.json"
    result = invoke("--url", server_url, "--vs", server_url.removesuffix("/v1"), "-c", "2",
                    "-n", "4", "--prompt-tokens", "8", "--output-tokens", "4",
                    "--json", str(out))
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert [t["num_ok"] for t in report["targets"]] == [4, 4]
    (row,) = report["comparison"]
    assert row["concurrency"] == 2
    for value in row.values():
        if isinstance(value, dict) and value["ratio"] is not None:
            assert value["ratio"] == pytest.approx(value["first"] / value["second"])
    first, second = (t["levels"][0]["output_tok_s"] for t in report["targets"])
    assert row["output_tok_s"]["ratio"] == pytest.approx(first / second)
    assert " vs " in result.stdout and "ratio" in result.stdout


def test_config_starts_skippyd_for_the_run_and_stops_it(config_path, tmp_path):
    out = tmp_path / "own.json"
    result = invoke("--config", str(config_path), "-c", "2", "-n", "3", "--prompt-tokens", "5",
                    "--output-tokens", "3", "--json", str(out))
    assert result.exit_code == 0, result.output
    (target,) = json.loads(out.read_text())["targets"]
    assert target["name"] == "skippyd" and target["num_ok"] == 3
    assert target["output_tokens"] == 9
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{target['url']}/models", timeout=5)


def test_lab_writes_rows(tmp_path):
    out = tmp_path / "lab.json"
    result = invoke("--lab", "--scenario", "cold-burst-n1", "--scenario", "radix-fcfs",
                    "--lab-runs", "0", "--json", str(out))
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())
    assert [row["scenario"] for row in rows] == ["cold-burst-n1", "radix-fcfs"]
    assert all(row["requests"] > 0 and row["makespan_ms"] > 0 for row in rows)
    assert "scheduler lab" in result.stdout
    result = invoke("--lab", "--scenario", "no-such-scenario")
    assert result.exit_code == ExitCode.USAGE
    assert "unknown scheduler lab scenario 'no-such-scenario'" in result.output


@pytest.mark.parametrize(("args", "message"), [
    (["-c", "1,,4"], "expected positive integers"),
    (["-c", "0"], "expected positive integers"),
    (["--output-tokens", "9:3"], "LOW must not exceed HIGH"),
    (["--prompt-tokens", "lots"], "expected N or LOW:HIGH"),
    (["--prompt-tokens", "8", "--shared-prefix", "8"], "--shared-prefix"),
    (["-n", "0"], "--requests"),
    (["--rate", "-2"], "--rate"),
])
def test_bad_options_fail_clearly(args, message):
    result = invoke("--url", "http://127.0.0.1:9/v1", *args)
    assert result.exit_code == ExitCode.USAGE
    assert message in " ".join(result.output.replace("│", " ").split())


def test_target_must_be_given_once(config_path):
    for args in ([], ["--url", "http://127.0.0.1:9", "--config", str(config_path)]):
        result = invoke(*args)
        assert result.exit_code == ExitCode.USAGE
        assert "exactly one target" in result.output


def test_unreachable_url_fails_without_a_traceback():
    result = invoke("--url", "http://127.0.0.1:9/v1", "-n", "1")
    assert result.exit_code == ExitCode.FAILURE
    assert "cannot reach http://127.0.0.1:9/v1" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_config_errors_are_reported(tmp_path):
    bad_key = tmp_path / "bad-key.toml"
    bad_key.write_text("[runtime]\nlane_cout = 3\n")
    result = invoke("--config", str(bad_key))
    assert result.exit_code == ExitCode.CONFIG
    assert 'runtime.lane_cout: unknown key (did you mean "lane_count"?)' in result.output
    missing = tmp_path / "missing-model.toml"
    missing.write_text(f'[stage]\nmodel_path = "{tmp_path / "none.gguf"}"\n')
    result = invoke("--config", str(missing), "-n", "1")
    assert result.exit_code == ExitCode.FAILURE
    assert "skippyd exited with code" in result.output and "none.gguf" in result.output


def _serve_children(pid: int) -> list[int]:
    """Children of ``pid`` that already run ``skippyd serve`` (past fork and exec)."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    children = [int(child) for child in path.read_text().split()] if path.exists() else []
    return [child for child in children
            if b"serve" in Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")]


def test_sigterm_stops_the_skippyd_it_started(config_path):
    bench = subprocess.Popen(
        [sys.executable, "-c", "from skippyd.bench.command import app; app()",
         "--config", str(config_path), "-c", "1", "-n", "100000", "--output-tokens", "64"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert "starting skippyd" in bench.stderr.readline()
        deadline = time.monotonic() + 30
        while not (children := _serve_children(bench.pid)):  # Popen follows the line
            assert time.monotonic() < deadline, "bench started no skippyd"
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) == 128 + signal.SIGTERM
        assert not any(Path(f"/proc/{child}").exists() for child in children)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pipeline_configs(model_path, workdir: Path) -> list[Path]:
    """Stages 0 (layers 0-2, HTTP) and 1 (layers 2-4) of the tiny model."""
    ports = [_free_port(), _free_port()]
    secret = "bench-pipeline-secret-0123456789"
    paths = []
    for index, layers in enumerate([(0, 2), (2, 4)]):
        text = (f'[stage]\nid = "tiny-{index}"\nindex = {index}\nmodel_path = "{model_path}"\n'
                f"layer_start = {layers[0]}\nlayer_end = {layers[1]}\n"
                "[runtime]\nctx_size = 512\nlane_count = 2\nthreads = 1\nthreads_batch = 1\n"
                f'slice_cache_dir = "{workdir / "slices"}"\n'
                f'[control]\nsocket = "{workdir / f"tiny{index}.sock"}"\n'
                f'[link]\nlisten = "127.0.0.1:{ports[index]}"\nsecret = "{secret}"\n')
        if index == 0:
            text += (f'[http]\nlisten = "127.0.0.1:0"\n[downstream]\nstage_id = "tiny-1"\n'
                     f'endpoint = "127.0.0.1:{ports[1]}"\n')
        else:
            text += f'[upstream]\nstage_id = "tiny-0"\nendpoint = "127.0.0.1:{ports[0]}"\n'
        path = workdir / f"stage{index}.toml"
        path.write_text(text)
        paths.append(path)
    return paths


def test_several_configs_start_the_whole_pipeline(tiny_model_path, tmp_path):
    stage0, stage1 = pipeline_configs(tiny_model_path, tmp_path)
    out = tmp_path / "pipeline.json"
    # Any order: the stages are started by index, the last one first.
    result = invoke("--config", str(stage1), "--config", str(stage0), "-c", "2", "-n", "3",
                    "--prompt-tokens", "5", "--output-tokens", "3", "--json", str(out))
    assert result.exit_code == 0, result.output
    (target,) = json.loads(out.read_text())["targets"]
    assert target["name"] == "skippyd (2 stages)" and target["num_ok"] == 3
    assert "starting a 2-stage pipeline" in result.output
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{target['url']}/models", timeout=5)


def test_configs_that_do_not_chain_are_refused(tiny_model_path, tmp_path):
    stage0, stage1 = pipeline_configs(tiny_model_path, tmp_path)
    result = invoke("--config", str(stage1), "-n", "1")
    assert result.exit_code == ExitCode.USAGE and "no stage 0 among the configs" in result.output
    stage1.write_text(stage1.read_text().replace("layer_start = 2", "layer_start = 3"))
    result = invoke("--config", str(stage0), "--config", str(stage1), "-n", "1")
    assert result.exit_code == ExitCode.CONFIG
    assert "do not form one pipeline" in result.output and "layer_start" in result.output
