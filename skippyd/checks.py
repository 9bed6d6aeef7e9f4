"""``skippyd config check``: every config against its model, then the pipeline they form.

Each config is loaded, validated, its link certificates checked (``link.tls``) and its
layer range checked against the model file it names; every problem of every config is collected, so one run shows all of them. When
several configs are valid, they must chain into one split pipeline. The verdict prints
as text lines or as JSON (``--json``) and maps to the exit codes of :class:`~skippyd.exitcodes.ExitCode`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from skippyd.config import ConfigError, StageConfig, check_layer_range, check_pipeline, load_config
from skippyd.exitcodes import ExitCode

if TYPE_CHECKING:
    from skippyd.model_files.model_info import ModelInfo

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ConfigVerdict:
    """The outcome of checking one config file."""

    path: Path
    config: StageConfig | None = None
    """The checked config (layer range resolved), or None when it is invalid."""
    errors: list[dict[str, str]] = field(default_factory=list)
    """``{"key", "message"}`` per problem; the key is the file for unreadable models."""
    model_error: bool = False
    """The model file named by the config could not be read."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": str(self.path), "ok": self.config is not None,
                               "errors": self.errors}
        if self.config is not None:
            stage = self.config.stage
            out["stage"] = {"id": stage.id, "index": stage.index, "model_id": stage.model_id,
                            "layer_start": stage.layer_start, "layer_end": stage.layer_end,
                            "is_first": self.config.is_first, "is_final": self.config.is_final}
        return out


@dataclass(slots=True)
class Line:
    """One line of the text report: ``ok`` lines go to stdout, errors to stderr."""

    ok: bool
    text: str


@dataclass(slots=True)
class CheckReport:
    """Every config's verdict and, for several valid configs, the pipeline's."""

    verdicts: list[ConfigVerdict]
    pipeline_errors: list[dict[str, str]] | None = None
    """None when no pipeline was checked (one config, or an invalid one)."""

    @property
    def exit_code(self) -> ExitCode:
        if any(v.config is None and not v.model_error for v in self.verdicts):
            return ExitCode.CONFIG
        if any(v.model_error for v in self.verdicts):
            return ExitCode.MODEL
        return ExitCode.CONFIG if self.pipeline_errors else ExitCode.OK

    def to_dict(self) -> dict[str, Any]:
        pipeline = None
        if self.pipeline_errors is not None:
            pipeline = {"ok": not self.pipeline_errors, "errors": self.pipeline_errors,
                        "stages": len(self.verdicts)}
        return {"ok": self.exit_code == 0, "configs": [v.to_dict() for v in self.verdicts],
                "pipeline": pipeline}

    def lines(self) -> list[Line]:
        out: list[Line] = []
        for verdict in self.verdicts:
            if verdict.config is not None:
                stage = verdict.config.stage
                out.append(Line(True, f"{verdict.path}: stage {stage.id} (index {stage.index}),"
                                      f" layers {stage.layer_start}:{stage.layer_end} of"
                                      f" {stage.model_id}"))
            else:
                out.append(Line(False, "\n".join([f"invalid config {verdict.path}",
                                                  *_issue_lines(verdict.errors)])))
        if self.pipeline_errors:
            out.append(Line(False, "\n".join(["the stages do not form one pipeline",
                                              *_issue_lines(self.pipeline_errors)])))
        elif self.pipeline_errors is not None:
            ordered = sorted((v.config for v in self.verdicts if v.config is not None),
                             key=lambda config: config.stage.index)
            last = ordered[-1].stage
            out.append(Line(True, f"pipeline: {len(ordered)} stages, layers"
                                  f" {ordered[0].stage.layer_start}:{last.layer_end} of"
                                  f" {last.model_id}"))
        return out


def _issue_lines(errors: list[dict[str, str]]) -> list[str]:
    return [f"{error['key']}: {error['message']}" for error in errors]


def _issues(exc: ConfigError) -> list[dict[str, str]]:
    return [{"key": issue.key, "message": issue.message} for issue in exc.issues]


def check_config_file(path: Path | None, *, size_context: bool = True,
                      **overrides: Any) -> StageConfig:
    """Load (or default) a config, apply overrides and check it against its model.

    ``size_context=False`` leaves an open ``runtime.ctx_size`` for the daemon, which sizes
    it when it loads the model and logs why.

    Raises:
        ConfigError: The config is invalid (its layer range included).
        ModelFileError: The model file cannot be read.
    """
    from skippyd.config import apply_overrides, default_config
    from skippyd.model_files.model_info import inspect_model

    config = load_config(path) if path is not None else default_config()
    if any(value is not None for value in overrides.values()):
        config = apply_overrides(config, **overrides)
    check_link_tls(config, None if path is None else str(path))
    info = inspect_model(config.resolved_model_path)
    config = check_layer_range(config, info.n_layer)
    return context_for_model(config, info)[0] if size_context else config


def check_link_tls(config: StageConfig, source: str | None = None) -> None:
    """With ``link.tls``: the CA, certificate and key must be this stage's and usable.

    Raises:
        ConfigError: Every problem of the three files, each naming its key.
    """
    if not config.link.tls:
        return
    from skippyd.config import ConfigIssue
    from skippyd.link.tls import TlsFiles, TlsSetupError, check_tls_files

    try:
        files = TlsFiles.from_config(config.link)
    except TlsSetupError as exc:
        raise ConfigError.single(exc.key, exc.message, source) from None
    assert files is not None
    problems = check_tls_files(files, config.stage.id)
    if problems:
        raise ConfigError([ConfigIssue(key, message) for key, message in problems], source)


def context_for_model(config: StageConfig, info: ModelInfo) -> tuple[StageConfig, str | None]:
    """``config`` with ``runtime.ctx_size`` sized from the model when it is left open
    (:func:`~skippyd.config.resolve_context`), and the sentence saying why."""
    from skippyd.config import available_memory_bytes, resolve_context

    start = config.stage.layer_start
    end = config.stage.layer_end or info.n_layer
    available = available_memory_bytes()
    if available is not None:  # less what this stage's share of the weights will take
        share = (end - start) / max(1, info.n_layer)
        available = max(0, available - int(info.file_bytes * share))
    return resolve_context(config, n_ctx_train=info.n_ctx_train, available_bytes=available,
                           kv_values_per_token=info.kv_values_per_token(start, end))


def check_one(path: Path) -> ConfigVerdict:
    """Check one config file and its model; never raises for a bad config or model."""
    from skippyd.model_files.model_info import ModelFileError

    verdict = ConfigVerdict(path)
    try:
        verdict.config = check_config_file(path)
    except ConfigError as exc:
        verdict.errors = _issues(exc)
    except ModelFileError as exc:
        verdict.errors = [{"key": str(path), "message": str(exc)}]
        verdict.model_error = True
    return verdict


def check_configs(paths: list[Path]) -> CheckReport:
    """Check every config, then (when all are valid and there are several) the pipeline."""
    report = CheckReport([check_one(path) for path in paths])
    configs = [v.config for v in report.verdicts if v.config is not None]
    if len(paths) > 1 and len(configs) == len(paths):
        try:
            check_pipeline(sorted(configs, key=lambda config: config.stage.index))
            report.pipeline_errors = []
        except ConfigError as exc:
            report.pipeline_errors = _issues(exc)
    return report
