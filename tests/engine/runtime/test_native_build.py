"""A run-time C helper is built once per process, and a failed build is remembered."""

from __future__ import annotations

import logging
import threading

import pytest

from skippyd.engine.runtime.native_build import CompiledOnce, build_shared_library


def test_a_helper_is_built_once_even_when_asked_from_many_threads():
    calls = []
    once = CompiledOnce(lambda: calls.append(1) or "lib", "helper", "doing without")
    threads = [threading.Thread(target=once.get) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert once.get() == "lib" and calls == [1] and once.unavailable is None


def test_a_failed_build_is_logged_once_and_not_retried(caplog):
    calls = []

    def build():
        calls.append(1)
        raise OSError("no C compiler (cc) found")

    once = CompiledOnce(build, "native thing", "using Python", logging.WARNING)
    with caplog.at_level(logging.WARNING):
        assert once.get() is None
        assert once.get() is None
    assert calls == [1]
    assert once.unavailable == "no C compiler (cc) found"
    assert [r.getMessage() for r in caplog.records] == [
        "native thing unavailable (no C compiler (cc) found); using Python"]
    once.forget()
    assert once.get() is None and calls == [1, 1]


def test_a_compiler_error_is_reported_with_its_message(tmp_path):
    with pytest.raises(OSError, match="failed: .*error"):
        build_shared_library("this is not C;", tmp_path / "bad.so")
