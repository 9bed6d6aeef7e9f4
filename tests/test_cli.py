"""The config and model commands through Typer's CliRunner (real files, real model scan)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from skippyd.cli import app
from skippyd.config import load_config
from skippyd.exitcodes import ExitCode

runner = CliRunner()
EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "configs"


def test_config_init_output_passes_check(tmp_path):
    path = tmp_path / "stage.toml"
    result = runner.invoke(app, ["config", "init", str(path)])
    assert result.exit_code == 0, result.output
    load_config(path)
    result = runner.invoke(app, ["config", "check", str(path)])
    assert result.exit_code == 0, result.output
    assert "ok" in result.output
    # Refuses to overwrite without --force.
    assert runner.invoke(app, ["config", "init", str(path)]).exit_code == 1


def test_config_check_reports_every_error_with_its_key(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[runtime]\nlane_cout = 3\n[stage]\nindex = 1\nlayer_start = 12\nlayer_end = 10\n")
    result = runner.invoke(app, ["config", "check", str(path)])
    assert result.exit_code == ExitCode.CONFIG
    assert 'runtime.lane_cout: unknown key (did you mean "lane_count"?)' in result.output
    assert "stage.layer_end: must be greater than layer_start (got 10 <= 12)" in result.output


def test_config_check_validates_layers_against_the_model(tmp_path, tiny_model_path):
    path = tmp_path / "stage.toml"
    path.write_text(f'[stage]\nmodel_path = "{tiny_model_path}"\nlayer_end = 9\n')
    result = runner.invoke(app, ["config", "check", str(path)])
    assert result.exit_code == ExitCode.CONFIG
    assert "stage.layer_end" in result.output and "4" in result.output


def test_config_show_json_has_resolved_defaults(tmp_path, tiny_model_path):
    path = tmp_path / "stage.toml"
    path.write_text(f'[stage]\nmodel_path = "{tiny_model_path}"\n')
    result = runner.invoke(app, ["config", "show", str(path), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["stage"]["layer_end"] == 4
    assert data["runtime"]["lane_count"] == 4


def test_model_inspect_json(tiny_model_path):
    result = runner.invoke(app, ["model", "inspect", str(tiny_model_path), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["n_layer"] == 4 and data["n_embd"] == 64 and data["has_chat_template"]


def test_model_inspect_missing_file(tmp_path):
    result = runner.invoke(app, ["model", "inspect", str(tmp_path / "nope.gguf")])
    assert result.exit_code == ExitCode.MODEL
    assert "not found" in result.output


def test_model_slice_writes_a_stage(tmp_path, tiny_model_path):
    out = tmp_path / "stage.gguf"
    result = runner.invoke(app, ["model", "slice", str(tiny_model_path), "--layers", "1:4", "-o", str(out)])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["model", "inspect", str(out), "--json"])
    assert json.loads(result.output)["n_layer"] == 3
    bad = runner.invoke(app, ["model", "slice", str(tiny_model_path), "--layers", "3", "-o", str(out)])
    assert bad.exit_code == ExitCode.USAGE


def test_config_check_of_several_stages_checks_the_pipeline(tmp_path):
    examples = sorted((EXAMPLES / "split-2").glob("*.toml"))
    result = runner.invoke(app, ["config", "check", *map(str, reversed(examples))])
    assert result.exit_code == 0, result.output
    assert "pipeline: 2 stages, layers 0:30" in result.output

    smaller = tmp_path / "stage1.toml"
    smaller.write_text(examples[1].read_text().replace(
        "threads_batch = 1\n", "threads_batch = 1\nn_batch = 256\nn_ubatch = 256\n"))
    result = runner.invoke(app, ["config", "check", str(examples[0]), str(smaller)])
    assert result.exit_code == ExitCode.CONFIG
    assert "do not form one pipeline" in result.output
    assert "stages[1].runtime.n_batch: must be at least stages[0].runtime.n_batch = 2048 " \
           "(got 256)" in " ".join(result.output.split())


def test_usage_config_and_model_errors_have_distinct_codes(tmp_path):
    assert len({int(code) for code in ExitCode}) == len(ExitCode)
    usage = runner.invoke(app, ["config", "check", "--no-such-option"])
    assert usage.exit_code == ExitCode.USAGE == 2
    bad = tmp_path / "bad.toml"
    bad.write_text("[runtime]\nlane_count = 0\n")
    assert runner.invoke(app, ["config", "check", str(bad)]).exit_code == ExitCode.CONFIG == 4
    missing = runner.invoke(app, ["model", "inspect", str(tmp_path / "none.gguf")])
    assert missing.exit_code == ExitCode.MODEL == 5
