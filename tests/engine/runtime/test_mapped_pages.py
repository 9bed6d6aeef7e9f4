"""A loaded model gives back the file pages llama.cpp no longer reads, and computes as before."""

from __future__ import annotations

import mmap
import os
import sys

import pytest

from skippyd.engine.runtime import mapped_pages
from skippyd.engine.runtime.contract import IterationRequest, RowPhase, SamplingConfig
from skippyd.engine.runtime.llama import LlamaRuntime, RuntimeOptions
from skippyd.engine.runtime.mapped_pages import file_mappings, release_file_pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc/self/smaps")


def resident_kib(path) -> int:
    """Resident KiB of this process's mappings of ``path`` (``/proc/self/smaps``)."""
    real = os.path.realpath(path)
    total, inside = 0, False
    with open("/proc/self/smaps", encoding="utf-8", errors="replace") as lines:
        for line in lines:
            fields = line.split()
            if fields and "-" in fields[0] and len(fields) >= 5 and ":" not in fields[0]:
                inside = len(fields) >= 6 and line.rstrip("\n").split(maxsplit=5)[5] == real
            elif inside and fields[0] == "Rss:":
                total += int(fields[1])
    return total


def test_released_pages_of_a_file_mapping_leave_and_read_back_the_same(tmp_path):
    path = tmp_path / "weights.bin"
    data = os.urandom(4 << 20)
    path.write_bytes(data)
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, prot=mmap.PROT_READ) as view:
        assert bytes(view[:]) == data  # every page read: resident
        assert resident_kib(path) >= 4 << 10
        assert file_mappings(path)
        assert release_file_pages(path) == len(data)
        assert resident_kib(path) < 1 << 10
        assert bytes(view[:]) == data  # read again from the file


def test_a_writable_mapping_keeps_its_pages(tmp_path):
    path = tmp_path / "scratch.bin"
    path.write_bytes(b"\0" * (1 << 20))
    with open(path, "r+b") as file, mmap.mmap(file.fileno(), 0) as view:
        view[:4] = b"kept"
        assert file_mappings(path) == []
        assert release_file_pages(path) == 0
        assert view[:4] == b"kept"


def test_a_file_not_mapped_releases_nothing(tmp_path):
    path = tmp_path / "other.bin"
    path.write_bytes(b"x" * 8192)
    assert file_mappings(path) == []
    assert release_file_pages(path) == 0


def _greedy(runtime: LlamaRuntime, prompt: list[int], steps: int = 8) -> list[int]:
    greedy = SamplingConfig(temperature=0.0)
    out = runtime.run_iteration([IterationRequest("s", prompt, sampling=greedy, sample_last=True)])
    tokens = [out.samples[0].token]
    for _ in range(steps - 1):
        out = runtime.run_iteration([IterationRequest("s", [tokens[-1]], sampling=greedy, sample_last=True,
                                                      phase=RowPhase.DECODE)])
        tokens.append(out.samples[0].token)
    runtime.drop_session("s")
    return tokens


@pytest.mark.model
def test_a_loaded_model_keeps_little_of_its_file_resident_and_generates_as_before(
        smollm2_path, monkeypatch):
    options = RuntimeOptions(str(smollm2_path), lane_count=1, ctx_size=256, threads=2)
    prompt = list(range(200, 240))
    monkeypatch.setattr("skippyd.engine.runtime.llama.release_file_pages", lambda path: 0)
    with LlamaRuntime(options) as kept:
        assert resident_kib(smollm2_path) > os.path.getsize(smollm2_path) // 1024 // 2
        expected = _greedy(kept, prompt)
    monkeypatch.setattr("skippyd.engine.runtime.llama.release_file_pages",
                        mapped_pages.release_file_pages)
    with LlamaRuntime(options) as released:
        assert resident_kib(smollm2_path) < os.path.getsize(smollm2_path) // 1024 // 2
        assert _greedy(released, prompt) == expected
