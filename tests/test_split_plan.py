"""`skippyd config split`: balanced layer ranges, within memory, configs that form one
pipeline."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from skippyd.cli import app
from skippyd.exitcodes import ExitCode
from skippyd.model_files.model_info import inspect_model
from skippyd.split_plan import (
    ModelCosts,
    SplitError,
    Work,
    model_costs,
    parse_size,
    plan_split,
)

runner = CliRunner()


def ranges(plans) -> list[tuple[int, int]]:
    return [(p.layer_start, p.layer_end) for p in plans]


def test_equal_layers_are_cut_evenly():
    costs = ModelCosts(layers=(10,) * 12, embedding=50, head=0)
    assert ranges(plan_split(costs, 3)) == [(0, 4), (4, 8), (8, 12)]


def test_the_output_head_moves_layers_off_the_final_stage():
    costs = ModelCosts(layers=(10,) * 12, embedding=50, head=30)
    plans = plan_split(costs, 2)
    assert ranges(plans) == [(0, 7), (7, 12)]  # 70 against 50 + 30: the lightest heaviest
    assert [p.compute_bytes for p in plans] == [70, 80]


def test_timed_work_moves_the_cut_where_weight_bytes_would_not():
    # Bytes say the head is free; the clock says it takes as long as four layers.
    costs = ModelCosts(layers=(10,) * 12, embedding=50, head=0)
    assert ranges(plan_split(costs, 2)) == [(0, 6), (6, 12)]
    timed = Work(layers=(1.0,) * 12, head=4.0, unit="ms")
    plans = plan_split(costs, 2, work=timed)
    assert ranges(plans) == [(0, 8), (8, 12)]
    assert [p.work for p in plans] == [8.0, 8.0]
    assert [p.compute_bytes for p in plans] == [80, 40]  # weights stay weights
    with pytest.raises(SplitError, match="11 layers"):
        plan_split(costs, 2, work=Work(layers=(1.0,) * 11, head=0.0, unit="ms"))


def test_a_small_host_gets_fewer_layers_and_no_cut_fits_too_little():
    costs = ModelCosts(layers=(10,) * 12, embedding=5, head=5)
    plans = plan_split(costs, 2, memory=[200, 40], hosts=["big", "small"])
    assert ranges(plans) == [(0, 9), (9, 12)]
    assert plans[1].memory_bytes <= 40 and [p.host for p in plans] == ["big", "small"]
    with pytest.raises(SplitError, match="--memory"):
        plan_split(costs, 2, memory=[30, 30])
    with pytest.raises(SplitError, match="--hosts"):
        plan_split(costs, 2, hosts=["only-one"])
    with pytest.raises(SplitError, match="--stages"):
        plan_split(costs, 13)


def test_sizes_read_like_people_write_them():
    assert parse_size("16G") == 16 << 30 and parse_size("512MiB") == 512 << 20
    assert parse_size("1.5g") == 3 << 29 and parse_size("1000") == 1000
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")


def test_a_model_s_costs_come_from_its_tensors(tiny_model_path):
    costs = model_costs(tiny_model_path)
    assert len(costs.layers) == 4 and len(set(costs.layers)) == 1
    # The head is the output matrix (the embedding's shape here) and its f32 norm.
    assert costs.embedding > 0 and costs.head == costs.embedding + 64 * 4


def split(tmp_path: Path, model: Path, *args: str) -> tuple[Path, list[dict]]:
    out = tmp_path / "split"
    result = runner.invoke(app, ["config", "split", str(model), "-o", str(out), *args])
    assert result.exit_code == 0, result.output
    paths = sorted(out.glob("stage-*.toml"))
    return out, [tomllib.loads(path.read_text()) for path in paths]


def test_the_configs_it_writes_form_one_pipeline(tmp_path, tiny_model_path):
    out, configs = split(tmp_path, tiny_model_path, "--stages", "2")
    assert [(c["stage"]["layer_start"], c["stage"]["layer_end"]) for c in configs] == [
        (0, 2), (2, 4)]
    assert configs[0]["link"]["secret"] == configs[1]["link"]["secret"]
    assert len(configs[0]["link"]["secret"]) >= 32 and "http" in configs[0]
    assert configs[0]["downstream"]["endpoint"] == "tcp://127.0.0.1:9102"
    # Each of the 4 lanes may hold the model's trained context, on every stage.
    trained = inspect_model(tiny_model_path).n_ctx_train
    assert [c["runtime"]["ctx_size"] for c in configs] == [4 * trained] * 2
    check = runner.invoke(app, ["config", "check", *map(str, sorted(out.glob("*.toml")))])
    assert check.exit_code == 0, check.output
    again = runner.invoke(app, ["config", "split", str(tiny_model_path), "-o", str(out)])
    assert again.exit_code != 0 and "exists" in again.output


def test_on_several_hosts_each_stage_listens_everywhere_and_says_where_it_is(
        tmp_path, tiny_model_path):
    _, configs = split(tmp_path, tiny_model_path, "--stages", "2",
                       "--hosts", "10.0.0.1,10.0.0.2", "--memory", "1G,1G")
    assert configs[0]["http"]["listen"] == "0.0.0.0:8080"
    assert configs[1]["link"] == {**configs[1]["link"], "listen": "0.0.0.0:9102",
                                  "advertise": "tcp://10.0.0.2:9102"}
    assert configs[0]["downstream"]["endpoint"] == "tcp://10.0.0.2:9102"
    assert configs[1]["upstream"]["endpoint"] == "tcp://10.0.0.1:9101"


def test_with_tls_every_stage_gets_its_own_keys_and_the_pipeline_checks(
        tmp_path, tiny_model_path):
    out, configs = split(tmp_path, tiny_model_path, "--stages", "2", "--tls")
    assert all(c["link"]["tls"] for c in configs)
    assert not (out / "tls" / "stage-2.crt").exists()
    assert configs[1]["link"]["tls_cert"] == "tls/stage-1.crt"
    assert (out / "tls" / "stage-1.key").stat().st_mode & 0o777 == 0o600
    check = runner.invoke(app, ["config", "check", *map(str, sorted(out.glob("*.toml")))])
    assert check.exit_code == 0, check.output


def test_splitting_again_with_tls_keeps_the_pipelines_keys_and_adds_a_new_stages(
        tmp_path, tiny_model_path):
    out, _ = split(tmp_path, tiny_model_path, "--stages", "2", "--tls")
    first = (out / "tls" / "stage-1.crt").read_bytes()
    result = runner.invoke(app, ["config", "split", str(tiny_model_path), "-o", str(out),
                                 "--stages", "3", "--tls", "--force"])
    assert result.exit_code == 0, result.output
    assert "kept the TLS keys of stage-0, stage-1" in result.output
    assert (out / "tls" / "stage-1.crt").read_bytes() == first
    assert (out / "tls" / "stage-2.key").stat().st_mode & 0o777 == 0o600
    check = runner.invoke(app, ["config", "check", *map(str, sorted(out.glob("*.toml")))])
    assert check.exit_code == 0, check.output


def test_a_split_whose_keys_lost_their_ca_is_refused(tmp_path, tiny_model_path):
    out, _ = split(tmp_path, tiny_model_path, "--stages", "2", "--tls")
    (out / "tls" / "ca.crt").unlink()
    result = runner.invoke(app, ["config", "split", str(tiny_model_path), "-o", str(out),
                                 "--stages", "2", "--tls", "--force"])
    assert result.exit_code != 0 and "no pipeline CA" in result.output


def test_a_split_that_cannot_be_made_is_refused_with_its_reason(tmp_path, tiny_model_path):
    result = runner.invoke(app, ["config", "split", str(tiny_model_path), "--stages", "9",
                                 "-o", str(tmp_path / "x")])
    assert result.exit_code == ExitCode.USAGE and "--stages" in result.output
    result = runner.invoke(app, ["config", "split", str(tmp_path / "missing.gguf")])
    assert result.exit_code == ExitCode.MODEL


@pytest.mark.model
def test_measure_times_the_layers_and_the_head_here_and_balances_by_time(
        tmp_path, smollm2_path, monkeypatch):
    from skippyd.split_measure import measure_work

    monkeypatch.delenv("CACHE_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the timed slices

    costs = model_costs(smollm2_path)
    seen = []
    work = measure_work(smollm2_path, costs, threads=2, steps=6, report=seen.append)
    assert [(t.layer_start, t.layer_end, t.head) for t in seen] == [
        (0, 1, False), (0, 7, False), (29, 30, True)]
    assert work.unit == "ms" and len(work.layers) == 30
    # Equal layers by weight take equal time; the slope between the timings is positive.
    assert len(set(costs.layers)) == 1 and min(work.layers) > 0
    assert work.head >= 0 and sum(work.layers) < 1000

    out, configs = split(tmp_path, smollm2_path, "--stages", "2", "--measure",
                         "--threads", "2")
    assert configs[0]["stage"]["layer_end"] == configs[1]["stage"]["layer_start"]
    check = runner.invoke(app, ["config", "check", *map(str, sorted(out.glob("*.toml")))])
    assert check.exit_code == 0, check.output


def test_measure_refuses_a_model_too_shallow_to_time(tiny_model_path):
    from skippyd.split_measure import measure_work

    costs = ModelCosts(layers=(10, 10), embedding=1, head=1)
    with pytest.raises(SplitError, match="3 layers"):
        measure_work(tiny_model_path, costs, threads=1)
