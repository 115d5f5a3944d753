"""Kervan's GGUF tensor index against llama.cpp's ``GGUFReader`` on files written by
llama.cpp's ``GGUFWriter``, and a clean ``ConfigError`` for files that are not GGUF."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from worker.config import ConfigError
from worker.quant.gguf_index import read_index


def write_gguf(path: Path, alignment: int | None = None) -> Path:
    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(3000)] + ["çay", ""])
    w.add_array("tokenizer.ggml.scores", [float(i) for i in range(100)])
    w.add_array("nested", [[1, 2, 3], ["a", "bb"], [[4], [5, 6]]])
    w.add_bool("flag", True)
    w.add_uint64("big", 2**40)
    w.add_float64("pi", 3.14159)
    w.add_int8("small", -3)
    w.add_tensor("output_norm.weight", rng.standard_normal(64).astype(np.float32))
    w.add_tensor("token_embd.weight", rng.standard_normal((5, 64)).astype(np.float16))
    q8 = rng.integers(0, 256, size=(3, 64 // 32 * 34), dtype=np.uint8)
    w.add_tensor("blk.0.ffn_down.weight", q8, raw_dtype=GGMLQuantizationType.Q8_0)
    q41 = rng.integers(0, 256, size=(4, 96 // 32 * 20), dtype=np.uint8)
    w.add_tensor("blk.0.ffn_up.weight", q41, raw_dtype=GGMLQuantizationType.Q4_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_the_index_is_gguf_readers_tensors_byte_for_byte(tmp_path, alignment):
    path = write_gguf(tmp_path / "m.gguf", alignment)
    want = GGUFReader(str(path)).tensors
    got = read_index(path)
    assert [t.name for t in got] == [t.name for t in want]
    for g, t in zip(got, want):
        assert g.kind == t.tensor_type.name
        assert g.shape == tuple(reversed(t.shape.tolist()))
        assert g.data.dtype == np.uint8 and g.data.tobytes() == np.asarray(t.data).tobytes()
    assert got[2].data.shape == (3, 68) and got[3].data.shape == (4, 60)  # rows of whole blocks


def test_a_file_that_is_not_a_gguf_is_a_config_error_naming_it(tmp_path):
    good = write_gguf(tmp_path / "m.gguf").read_bytes()
    cases = {
        "magic": b"GGML" + good[4:],
        "version": good[:4] + (9).to_bytes(4, "little") + good[8:],
        "truncated header": good[:200],
        "string past the end": good[:24] + (2**40).to_bytes(8, "little") + good[32:],  # the first key's length
        "value type": good[:24 + 8 + len("general.architecture")] + (77).to_bytes(4, "little") + good[60:],
        "truncated data": good[:-100],
        "empty": b"",
    }
    for why, data in cases.items():
        path = tmp_path / f"{why.replace(' ', '_')}.gguf"
        path.write_bytes(data)
        with pytest.raises(ConfigError, match=f"{path.name} is not a well-formed GGUF file"):
            read_index(path)


def test_metadata_values_of_every_type_are_skipped_by_their_lengths(tmp_path):
    path = write_gguf(tmp_path / "m.gguf")
    reader = GGUFReader(str(path))
    kinds = {reader.fields[k].types[0] for k in reader.fields}
    assert {GGUFValueType.STRING, GGUFValueType.ARRAY, GGUFValueType.BOOL, GGUFValueType.UINT64,
            GGUFValueType.FLOAT64, GGUFValueType.INT8} <= kinds
    assert [t.name for t in read_index(path)][-1] == "blk.0.ffn_up.weight"
