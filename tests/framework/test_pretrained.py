"""The SmolLM2 conversion's speed-up: transformers' GGUF loader parses the file once, not three times."""
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from phalanx.pretrained import _gguf_parsed_once  # noqa: E402


def _tiny_gguf(path):
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_file_is_parsed_once_inside_and_normally_outside(tmp_path):
    path = _tiny_gguf(tmp_path / "tiny.gguf")
    make_reader, make_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with _gguf_parsed_once():
        from gguf import GGUFReader, get_tensor_name_map  # what transformers does, at call time

        first, second = GGUFReader(path), GGUFReader(str(path))
        assert first is second
        assert np.array_equal(np.asarray(first.tensors[0].data).reshape(3, 4),
                              np.arange(12, dtype=np.float32).reshape(3, 4))
        arch = gguf.MODEL_ARCH.LLAMA
        assert get_tensor_name_map(arch, 2) is get_tensor_name_map(arch, 2)
    assert gguf.GGUFReader is make_reader and gguf.get_tensor_name_map is make_map
    assert gguf.GGUFReader(path) is not gguf.GGUFReader(path)


def test_the_patch_is_undone_when_loading_fails(tmp_path):
    make_reader = gguf.GGUFReader
    with pytest.raises(FileNotFoundError), _gguf_parsed_once():
        gguf.GGUFReader(tmp_path / "missing.gguf")
    assert gguf.GGUFReader is make_reader
