"""How stage 0 reports a next stage it cannot reach: quietly while the pipeline is
starting (stages come up in any order), as a warning once it should be there."""

from __future__ import annotations

import logging
import threading

from link_support import free_port

from skippyd.link import dialer
from skippyd.link.dialer import ChainIdentity, ChainLink

LOGGER = "skippyd.link.dialer"


class _Listener:
    def on_result(self, epoch, request_id, samples) -> None: ...

    def on_error(self, epoch, request_id, message) -> None: ...

    def on_down(self, epoch, reason) -> None: ...


class _Records(logging.Handler):
    """Collects the dialer's 'cannot reach' lines and says when there are enough."""

    def __init__(self, wanted: int) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.enough = threading.Event()
        self.wanted = wanted

    def emit(self, record: logging.LogRecord) -> None:
        if "cannot reach the pipeline" in record.getMessage():
            self.records.append(record)
            if len(self.records) >= self.wanted:
                self.enough.set()


def _refusals(wanted: int) -> list[logging.LogRecord]:
    # Nothing listens on the port: every dial is refused at once.
    identity = ChainIdentity("stage-1", ("127.0.0.1", free_port()), b"s" * 32, "m", 4,
                             8, 1, 64, 64, 1 << 20)
    records = _Records(wanted)
    log = logging.getLogger(LOGGER)
    log.addHandler(records)
    previous = log.level
    log.setLevel(logging.DEBUG)
    link = ChainLink(identity)
    try:
        link.start(_Listener())
        assert records.enough.wait(10), [r.getMessage() for r in records.records]
    finally:
        link.close()
        log.removeHandler(records)
        log.setLevel(previous)
    assert not link.is_up and "stage-1" in (link.down_reason() or "")
    return records.records[:wanted]


def test_a_refusal_while_the_pipeline_starts_is_said_once_at_info():
    first, *repeats = _refusals(3)
    assert first.levelno == logging.INFO
    assert "stage-1 at 127.0.0.1" in first.getMessage()
    assert [r.levelno for r in repeats] == [logging.DEBUG, logging.DEBUG]


def test_after_the_start_up_grace_a_refusal_is_a_warning_said_once(monkeypatch):
    monkeypatch.setattr(dialer, "STARTUP_GRACE_S", 0.0)
    levels = [r.levelno for r in _refusals(3)]
    assert levels == [logging.WARNING, logging.DEBUG, logging.DEBUG]


def test_a_refusal_that_outlasts_the_grace_is_raised_to_a_warning(monkeypatch):
    monkeypatch.setattr(dialer, "STARTUP_GRACE_S", 0.25)
    levels = [r.levelno for r in _refusals(4)]  # waits 0.1, 0.2, 0.4 s between dials
    assert levels[0] == logging.INFO
    assert levels.count(logging.WARNING) == 1, levels
    assert levels.index(logging.WARNING) > 0
