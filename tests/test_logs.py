"""Log lines: syslog priorities and no timestamp under systemd, JSON on request."""

from __future__ import annotations

import json
import logging
import os
import re
import sys

import pytest

from skippyd.logs import JournalFormatter, journal_stream, make_handler, syslog_priority


def record(level: int, message: str, **extra) -> logging.LogRecord:
    rec = logging.LogRecord("skippyd.test", level, __file__, 1, message, (), None)
    rec.__dict__.update(extra)
    return rec


def journal_env(stream) -> dict[str, str]:
    info = os.fstat(stream.fileno())
    return {"JOURNAL_STREAM": f"{info.st_dev}:{info.st_ino}"}


def test_levels_map_to_syslog_priorities():
    assert [syslog_priority(level) for level in (logging.CRITICAL, logging.ERROR,
                                                 logging.WARNING, logging.INFO,
                                                 logging.DEBUG)] == [2, 3, 4, 6, 7]


def test_journal_stream_must_be_our_very_stderr(tmp_path):
    with open(tmp_path / "journal", "w") as journal, open(tmp_path / "other", "w") as other:
        env = journal_env(journal)
        assert journal_stream(journal, env)
        assert not journal_stream(other, env)  # inherited variable, redirected stream
        assert not journal_stream(journal, {})
        assert not journal_stream(journal, {"JOURNAL_STREAM": "garbage"})


def test_under_systemd_lines_carry_a_priority_and_no_timestamp(tmp_path):
    with open(tmp_path / "journal", "w") as journal:
        handler = make_handler("auto", journal, journal_env(journal))
        handler.emit(record(logging.WARNING, "queue is full"))
        handler.emit(record(logging.ERROR, "first line\nsecond line"))
        handler.emit(record(logging.INFO, "serving"))
    lines = (tmp_path / "journal").read_text().splitlines()
    assert lines == ["<4>skippyd.test: queue is full", "<3>skippyd.test: first line",
                     "<3>second line", "<6>skippyd.test: serving"]


def test_elsewhere_plain_text_keeps_its_timestamp(tmp_path):
    with open(tmp_path / "log", "w") as log:
        make_handler("auto", log, {}).emit(record(logging.INFO, "serving"))
    line = (tmp_path / "log").read_text()
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO skippyd.test: serving$", line)


@pytest.mark.parametrize("journal", [False, True])
def test_json_lines_with_fields(tmp_path, journal):
    with open(tmp_path / "log", "w") as log:
        env = journal_env(log) if journal else {}
        handler = make_handler("json", log, env)
        handler.emit(record(logging.WARNING, "request r1 done", fields={"request_id": "r1",
                                                                      "status": 200}))
    line = (tmp_path / "log").read_text().rstrip("\n")
    if journal:
        assert line.startswith("<4>{")
        line = line[3:]
    data = json.loads(line)
    assert data["level"] == "warning" and data["logger"] == "skippyd.test"
    assert data["message"] == "request r1 done"
    assert data["request_id"] == "r1" and data["status"] == 200
    assert ("ts" in data) is not journal  # the journal stamps its entries itself


def test_journal_formatter_prefixes_tracebacks_line_by_line():
    try:
        raise ValueError("boom")
    except ValueError:
        rec = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    lines = JournalFormatter().format(rec).splitlines()
    assert len(lines) > 2 and all(line.startswith("<3>") for line in lines)
