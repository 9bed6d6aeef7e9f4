"""GGUF inspection and slicing on the tiny model; tokenizer and chat template."""

from __future__ import annotations

import errno
import os
import shutil

import gguf
import numpy as np
import pytest

from skippyd.engine.runtime.contract import IterationRequest
from skippyd.engine.runtime.llama import LlamaRuntime, RuntimeOptions
from skippyd.engine.runtime.tokenizer import Tokenizer
from skippyd.model_files.model_info import ModelFileError, inspect_model, read_model_header
from skippyd.model_files.slice import cached_slice, file_identity, slice_model


def test_inspect_reports_the_model(tiny_model_path):
    info = inspect_model(tiny_model_path)
    assert (info.architecture, info.n_layer, info.n_embd) == ("llama", 4, 64)
    assert info.n_vocab == 303
    assert info.quantization == "ALL_F32"
    assert info.has_chat_template
    assert info.recurrent_state_bytes_per_layer == (0, 0, 0, 0)
    assert info.file_bytes == tiny_model_path.stat().st_size
    assert info.to_dict()["recurrent_state_bytes_total"] == 0


def test_inspect_rejects_non_gguf(tmp_path):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a model at all")
    with pytest.raises(ModelFileError, match="not a readable GGUF"):
        inspect_model(bogus)
    with pytest.raises(ModelFileError, match="not found"):
        inspect_model(tmp_path / "missing.gguf")


def test_slice_is_a_shallower_model(tiny_model_path, tmp_path):
    out = slice_model(tiny_model_path, 1, 3, tmp_path / "mid.gguf")
    info = inspect_model(out)
    assert info.n_layer == 2
    assert info.n_embd == 64
    with LlamaRuntime(RuntimeOptions(str(out), lane_count=1, ctx_size=256, n_batch=64,
                                     n_ubatch=32, threads=2, first_stage=False,
                                     final_stage=False)) as rt:
        import numpy as np

        rows = rt.run_iteration(
            [IterationRequest("a", input_rows=np.ones((3, 64), np.float32))]
        ).output_rows[0]
        assert rows.shape == (3, 64) and np.isfinite(rows).all()


@pytest.mark.parametrize(("start", "end"), [(2, 2), (3, 1), (0, 5), (-1, 2)])
def test_slice_rejects_bad_ranges(tiny_model_path, tmp_path, start, end):
    with pytest.raises(ModelFileError, match="not within the model's 4 layers"):
        slice_model(tiny_model_path, start, end, tmp_path / "bad.gguf")
    assert list(tmp_path.iterdir()) == []


def test_slice_cache_writes_once(tiny_model_path, tmp_path):
    first = cached_slice(tiny_model_path, 0, 2, tmp_path)
    mtime = first.stat().st_mtime_ns
    again = cached_slice(tiny_model_path, 0, 2, tmp_path)
    assert again == first and again.stat().st_mtime_ns == mtime
    assert cached_slice(tiny_model_path, 0, 4, tmp_path) == tiny_model_path  # whole model


def test_slice_cache_key_is_the_header_the_size_and_the_mtime(tiny_model_path, tmp_path):
    """A warm start reads the header only: hashing a big model's weights took minutes."""
    source, cache = tmp_path / "model.gguf", tmp_path / "cache"
    shutil.copyfile(tiny_model_path, source)
    first = cached_slice(source, 0, 2, cache)
    key, stat = file_identity(source), source.stat()
    data = bytearray(source.read_bytes())
    data[read_model_header(source).data_offset + 10] ^= 0xFF  # one weight byte
    source.write_bytes(data)
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert file_identity(source) == key  # the weights are not read
    assert cached_slice(source, 0, 2, cache) == first

    source.write_bytes(data)  # written again: a new mtime, a new slice
    assert file_identity(source) != key
    fresh = cached_slice(source, 0, 2, cache)
    assert fresh != first and fresh.is_file()


def test_failed_slice_leaves_no_half_file(tiny_model_path, tmp_path):
    def disk_full(done, total):
        if done < total:
            raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        cached_slice(tiny_model_path, 0, 3, tmp_path, progress=disk_full)
    assert list(tmp_path.iterdir()) == []


def test_tokenizer_round_trip_and_utf8_safe_streaming(tiny_model_path):
    tok = Tokenizer(tiny_model_path)
    try:
        ids = tok.tokenize("héllo wörld 🦙")
        assert ids[0] == tok.bos_token_id
        assert tok.detokenize(ids[1:]) == " héllo wörld 🦙"
        detok = tok.detokenizer()
        pieces = [detok.feed(t) for t in ids[1:]]
        # Multi-byte characters come as several byte tokens: no piece is ever a fragment.
        assert "\ufffd" not in "".join(pieces)
        assert "".join(pieces) + detok.flush() == " héllo wörld 🦙"
        assert any(p == "" for p in pieces)  # bytes were held back mid-character
        assert tok.render_chat([{"role": "user", "content": "hi"}]) == "<|user|>hi</s><|assistant|>"
    finally:
        tok.close()


def test_a_header_larger_than_the_first_read_is_read_whole(tmp_path):
    """A big tokenizer table pushes the header past the first MiB read."""
    path = tmp_path / "big-header.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("tokenizer.ggml.merges", [f"merge-{i:07d} x" for i in range(150_000)])
    writer.add_uint32("llama.block_count", 1)
    writer.add_array("llama.kept", list(range(3000)))
    writer.add_tensor("blk.0.w", np.ones((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    header = read_model_header(path)
    reference = gguf.GGUFReader(str(path))
    assert header.data_offset == reference.data_offset > 2 << 20
    assert header.kv["tokenizer.ggml.merges"].length == 150_000
    assert header.get("llama.kept") == list(range(3000))
    assert [t.name for t in header.tensors] == ["blk.0.w"]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: 3 << 20])
    with pytest.raises(ModelFileError, match="not a readable GGUF"):
        read_model_header(cut)
