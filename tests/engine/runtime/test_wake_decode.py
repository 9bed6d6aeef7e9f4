"""The compute hook's eventfds: signalled as each llama_decode starts, natively or not."""

from __future__ import annotations

import os
import threading

import pytest
from test_runtime import generate, prompt, small_runtime, tokenizer  # noqa: F401 (fixture)

from skippyd.engine.runtime import native, wake_decode


@pytest.fixture
def eventfds():
    fds = [os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC) for _ in range(2)]
    yield fds
    for fd in fds:
        os.close(fd)


def read_count(fd: int) -> int:
    try:
        return os.eventfd_read(fd)
    except BlockingIOError:
        return 0


@pytest.fixture(params=["native", "python"])
def mode(request, monkeypatch):
    if request.param == "native":
        if native.helpers().signal_decode is None:
            pytest.skip("the install built no native helpers")
    else:
        monkeypatch.setattr(wake_decode, "helpers", lambda: native.NativeHelpers(None, "off"))
    return request.param


def test_every_decode_signals_what_the_hook_returned_and_decodes_the_same(
        tiny_model_path, tokenizer, eventfds, mode):  # noqa: F811
    sessions = {"a": prompt(tokenizer, "the cat"), "b": prompt(tokenizer, "a dog")}
    with small_runtime(tiny_model_path, 2, 128) as rt:
        plain = generate(rt, sessions, steps=4)
    wakes: list[tuple[int, ...]] = []
    hooked_thread: list[threading.Thread] = []

    def hook() -> tuple[int, ...]:
        hooked_thread.append(threading.current_thread())
        wake = tuple(eventfds) if len(wakes) % 2 == 0 else ()
        wakes.append(wake)
        return wake

    with small_runtime(tiny_model_path, 2, 128) as rt:
        assert rt.set_compute_hook(hook)
        calls_before = rt.decode_calls
        hooked = generate(rt, sessions, steps=4)
        decodes = rt.decode_calls - calls_before
    assert hooked == plain
    assert len(wakes) == decodes == 4
    assert hooked_thread == [threading.current_thread()] * 4
    # Both descriptors, once per decode whose hook returned them, and no other time.
    assert [read_count(fd) for fd in eventfds] == [2, 2]


def test_a_failing_decode_call_still_signals(eventfds, monkeypatch):
    def broken(*args):
        raise ctypes_error

    ctypes_error = TypeError("wrong argument")
    monkeypatch.setattr(wake_decode, "helpers",
                        lambda: native.NativeHelpers(None, signal_decode=broken))
    with pytest.raises(TypeError, match="wrong argument"):
        wake_decode.decode_signalling(eventfds[:1], None, None)
    assert read_count(eventfds[0]) == 1  # an extra wake-up is harmless, a lost one is not


def test_a_closed_eventfd_is_skipped_quietly():
    fd = os.eventfd(0)
    os.close(fd)
    wake_decode.signal_eventfds([fd])  # nothing raised: its owner stopped listening
