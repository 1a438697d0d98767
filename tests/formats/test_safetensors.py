"""The safetensors reader validates folders and reads lazily; the writer streams deterministic shards."""

import gc
import hashlib
import json
import os
import struct
import tracemalloc
import weakref

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from checkpoints import make_llama_checkpoint, minilm_path
from qconvert.formats.errors import FormatError
from qconvert.formats.safetensors_io import TensorSpec, open_checkpoint, read_header, sha256_file, write_shards


def sample_tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "z.bf16": rng.standard_normal((3, 5)).astype(ml_dtypes.bfloat16),
        "a.f32": rng.standard_normal((4,)).astype(np.float32),
        "m.f16": rng.standard_normal((2, 2, 3)).astype(np.float16),
        "m.i8": rng.integers(-128, 128, (7, 3)).astype(np.int8),
        "m.i32": rng.integers(-(2**31), 2**31 - 1, (5,)).astype(np.int32),
        "m.i64": np.array([7, -1], dtype=np.int64),
        "m.u8": rng.integers(0, 256, (9, 1)).astype(np.uint8),
        "m.bool": np.array([True, False, True]),
        "m.scalar": np.array(3.5, dtype=np.float32),
        "m.empty": np.zeros((0, 3), dtype=np.float32),
    }


def specs_of(tensors: dict[str, np.ndarray]) -> list[TensorSpec]:
    return [TensorSpec(name, array.dtype, array.shape) for name, array in tensors.items()]


def assert_same_bytes(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


def test_single_shard_reads_back_byte_for_byte_with_safetensors(tmp_path):
    tensors = sample_tensors()
    hashes = write_shards(tmp_path, specs_of(tensors), tensors.items(), max_shard_size=1 << 30)
    assert list(hashes) == ["model.safetensors"]
    loaded = load_file(str(tmp_path / "model.safetensors"))
    assert sorted(loaded) == sorted(tensors)
    with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as f:
        assert f.metadata() == {"format": "pt"}
        for name, array in tensors.items():
            assert_same_bytes(f.get_tensor(name), array)
            assert_same_bytes(loaded[name], array)


def test_sharding_cuts_at_max_size_and_indexes_sorted(tmp_path):
    tensors = {f"t{i}": np.full((10,), i, dtype=np.float32) for i in (3, 1, 2, 0, 4)}  # 40 bytes each
    hashes = write_shards(tmp_path, specs_of(tensors), tensors.items(), max_shard_size=100)
    shard_names = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert sorted(hashes) == sorted(shard_names + ["model.safetensors.index.json"])
    contents = [load_file(str(tmp_path / name)) for name in shard_names]
    # Greedy in write order: two 40-byte tensors fit under 100, a third does not.
    assert [list(c) for c in contents] == [["t3", "t1"], ["t2", "t0"], ["t4"]]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"total_size": 200}
    assert list(index["weight_map"]) == sorted(tensors)
    assert index["weight_map"]["t4"] == shard_names[2] and index["weight_map"]["t1"] == shard_names[0]
    for content in contents:
        for name, array in content.items():
            assert_same_bytes(array, tensors[name])


def test_a_tensor_larger_than_the_limit_gets_its_own_shard(tmp_path):
    tensors = {"small": np.zeros(2, np.float32), "big": np.zeros(100, np.float32), "tail": np.zeros(2, np.float32)}
    write_shards(tmp_path, specs_of(tensors), tensors.items(), max_shard_size=64)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {
        "big": "model-00002-of-00003.safetensors",
        "small": "model-00001-of-00003.safetensors",
        "tail": "model-00003-of-00003.safetensors",
    }


def test_output_is_byte_deterministic_hashed_and_world_readable(tmp_path):
    tensors = sample_tensors()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    old_umask = os.umask(0o077)
    try:
        first = write_shards(tmp_path / "a", specs_of(tensors), tensors.items(), max_shard_size=64)
        second = write_shards(tmp_path / "b", specs_of(tensors), tensors.items(), max_shard_size=64)
    finally:
        os.umask(old_umask)
    assert first == second and len(first) > 2
    for name, digest in first.items():
        data_a = (tmp_path / "a" / name).read_bytes()
        assert data_a == (tmp_path / "b" / name).read_bytes()
        assert hashlib.sha256(data_a).hexdigest() == digest == sha256_file(tmp_path / "a" / name)
        assert (tmp_path / "a" / name).stat().st_mode & 0o777 == 0o644


def test_header_is_compact_json_padded_to_8_bytes(tmp_path):
    tensors = {"b": np.arange(3, dtype=np.int8), "a": np.ones((1, 2), ml_dtypes.bfloat16)}
    write_shards(tmp_path, specs_of(tensors), tensors.items(), 1 << 20, metadata={"producer": "test"})
    raw = (tmp_path / "model.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    assert length % 8 == 0
    header = raw[8 : 8 + length].decode()
    assert header.rstrip(" ") == (
        '{"__metadata__":{"format":"pt","producer":"test"},'
        '"b":{"dtype":"I8","shape":[3],"data_offsets":[0,3]},'
        '"a":{"dtype":"BF16","shape":[1,2],"data_offsets":[3,7]}}'
    )
    assert raw[8 + length :] == bytes([0, 1, 2]) + np.ones(2, ml_dtypes.bfloat16).tobytes()


def test_writer_consumes_tensors_lazily_one_at_a_time(tmp_path):
    specs = [TensorSpec(f"t{i}", np.float32, (256, 1024)) for i in range(8)]  # 1 MiB each
    produced: list[weakref.ref] = []
    alive_when_yielding: list[int] = []

    def generate():
        for i, spec in enumerate(specs):
            gc.collect()
            alive_when_yielding.append(sum(ref() is not None for ref in produced))
            array = np.full(spec.shape, i, dtype=np.float32)
            produced.append(weakref.ref(array))
            yield spec.name, array
            del array

    tracemalloc.start()
    try:
        write_shards(tmp_path, specs, generate(), max_shard_size=3 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # At most the tensor just written may still be referenced when the next is made.
    assert max(alive_when_yielding) <= 1
    assert peak < 3.5 * (1 << 20), f"peak {peak} bytes for 1 MiB tensors"
    checkpoint = open_checkpoint(tmp_path)
    assert checkpoint.tensor_names == sorted(s.name for s in specs)
    assert float(checkpoint.get("t5")[0, 0]) == 5.0


@pytest.mark.parametrize(
    "bad",
    [
        [("t0", np.zeros(4, np.float16)), ("t1", np.zeros(4, np.float32))],  # wrong dtype
        [("t0", np.zeros(5, np.float32)), ("t1", np.zeros(4, np.float32))],  # wrong shape
        [("t1", np.zeros(4, np.float32)), ("t0", np.zeros(4, np.float32))],  # wrong order
        [("t0", np.zeros(4, np.float32))],  # too few
        [("t0", np.zeros(4, np.float32)), ("t1", np.zeros(4, np.float32)), ("t2", np.zeros(1, np.float32))],
    ],
)
def test_writer_refuses_tensors_that_do_not_match_the_specs(tmp_path, bad):
    specs = [TensorSpec("t0", np.float32, (4,)), TensorSpec("t1", np.float32, (4,))]
    with pytest.raises(ValueError):
        write_shards(tmp_path, specs, iter(bad), max_shard_size=1 << 20)


def test_reader_reads_sharded_bf16_checkpoint_like_safetensors(tmp_path):
    folder = make_llama_checkpoint(tmp_path / "llama", shards=3, dtype="bfloat16")
    checkpoint = open_checkpoint(folder)
    assert [p.name for p in checkpoint.files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    expected = {}
    for path in checkpoint.files:
        for name, array in load_file(str(path)).items():
            expected[name] = (path, array)
    assert checkpoint.tensor_names == sorted(expected)
    for name, (path, array) in expected.items():
        assert checkpoint.file_of(name) == path
        assert checkpoint.shape(name) == array.shape
        assert checkpoint.dtype(name) == np.dtype(ml_dtypes.bfloat16) == array.dtype
        assert_same_bytes(checkpoint.get(name), array)


def test_reader_reads_the_real_minilm_checkpoint():
    folder = minilm_path()
    checkpoint = open_checkpoint(folder)
    reference = load_file(str(folder / "model.safetensors"))
    assert checkpoint.tensor_names == sorted(reference)
    name = "encoder.layer.0.attention.self.query.weight"
    if name not in reference:
        name = next(n for n in reference if n.endswith("query.weight"))
    assert checkpoint.shape(name) == (384, 384)
    assert_same_bytes(checkpoint.get(name), reference[name])


def test_header_validation_reads_no_tensor_data(tmp_path):
    # A 2 GiB tensor in a sparse file: validating it must not touch its bytes.
    path = tmp_path / "model.safetensors"
    header = json.dumps({"w": {"dtype": "F32", "shape": [1 << 29], "data_offsets": [0, 1 << 31]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + (1 << 31))
    checkpoint = open_checkpoint(tmp_path)
    assert checkpoint.shape("w") == (1 << 29,) and checkpoint.nbytes("w") == 1 << 31


def write_one(path, tensors=None):
    save_file(tensors or {"a": np.arange(6, dtype=np.float32), "b": np.ones((2, 2), np.int8)}, str(path))


def raw_file(path, header: dict, data: bytes):
    body = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)


def test_truncated_file_is_reported_by_name(tmp_path):
    write_one(tmp_path / "model.safetensors")
    raw = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(raw[:-5])
    with pytest.raises(FormatError, match=r"model\.safetensors.*truncated"):
        open_checkpoint(tmp_path)


@pytest.mark.parametrize(
    "header, data, message",
    [
        ({"a": {"dtype": "F33", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, "unknown dtype"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4, "needs 8"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8, "expected 0"),
        (
            {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
             "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}},
            b"\0" * 8, "overlapping",
        ),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 6, "trailing"),
        ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, "invalid shape"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, b"\0" * 4, "invalid data_offsets"),
        ({"__metadata__": {"x": 1}}, b"", "__metadata__"),
        ([1, 2], b"", "not a JSON object"),
    ],
)
def test_corrupt_headers_are_refused(tmp_path, header, data, message):
    raw_file(tmp_path / "x.safetensors", header, data)
    with pytest.raises(FormatError, match=message) as info:
        open_checkpoint(tmp_path)
    assert "x.safetensors" in str(info.value)


@pytest.mark.parametrize(
    "raw, message",
    [
        (b"\x01\x02", "not a safetensors file"),
        (struct.pack("<Q", 1 << 40) + b"{}", "header length"),
        (struct.pack("<Q", 0), "header length"),
        (struct.pack("<Q", 4) + b"{abc", "invalid JSON"),
        (struct.pack("<Q", 2) + b"\xff\xfe", "invalid JSON"),
    ],
)
def test_garbage_files_are_refused(tmp_path, raw, message):
    (tmp_path / "model.safetensors").write_bytes(raw)
    with pytest.raises(FormatError, match=message):
        read_header(tmp_path / "model.safetensors")
    with pytest.raises(FormatError):
        open_checkpoint(tmp_path)


def write_index(folder, weight_map):
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_index_naming_a_missing_file_is_refused(tmp_path):
    write_one(tmp_path / "model-00001-of-00002.safetensors")
    write_index(tmp_path, {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"})
    with pytest.raises(FormatError, match="model-00002-of-00002.safetensors.*missing"):
        open_checkpoint(tmp_path)


@pytest.mark.parametrize("fname", ["../outside.safetensors", "sub/../../outside.safetensors", "/tmp/outside.safetensors"])
def test_index_path_outside_the_folder_is_refused(tmp_path, fname):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    write_one(tmp_path / "outside.safetensors")
    write_index(folder, {"a": fname})
    with pytest.raises(FormatError, match="outside the checkpoint folder"):
        open_checkpoint(folder)


def test_index_listing_a_tensor_its_shard_lacks_is_refused(tmp_path):
    write_one(tmp_path / "model-00001-of-00001.safetensors")
    write_index(tmp_path, {"a": "model-00001-of-00001.safetensors", "ghost": "model-00001-of-00001.safetensors"})
    with pytest.raises(FormatError, match="ghost"):
        open_checkpoint(tmp_path)


def test_invalid_index_json_is_refused(tmp_path):
    write_one(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(FormatError, match="index"):
        open_checkpoint(tmp_path)


def test_symlinked_shards_as_in_the_hub_cache_are_accepted(tmp_path):
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshot"
    blobs.mkdir()
    snapshot.mkdir()
    write_one(blobs / "abc123")
    (snapshot / "model.safetensors").symlink_to(blobs / "abc123")
    write_index(snapshot, {"a": "model.safetensors", "b": "model.safetensors"})
    checkpoint = open_checkpoint(snapshot)
    np.testing.assert_array_equal(checkpoint.get("a"), np.arange(6, dtype=np.float32))


def test_duplicate_tensor_across_unindexed_files_is_refused(tmp_path):
    write_one(tmp_path / "one.safetensors")
    write_one(tmp_path / "two.safetensors")
    with pytest.raises(FormatError, match="also appears"):
        open_checkpoint(tmp_path)


def test_folder_without_safetensors_is_refused(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0")
    with pytest.raises(FormatError, match="no .safetensors"):
        open_checkpoint(tmp_path)


def test_unaligned_tensor_offsets_load_in_torch(tmp_path):
    # Odd-sized uint8 tensors push later tensors off their natural alignment; torch loaders must cope.
    import torch
    from safetensors.torch import load_file as torch_load_file

    tensors = {"packed": np.arange(3, dtype=np.uint8), "absmax": np.array([1.5, 2.5], np.float32),
               "shape": np.array([7, 9], np.int64), "scale": np.ones(3, np.float16)}
    write_shards(tmp_path, specs_of(tensors), tensors.items(), 1 << 20)
    loaded = torch_load_file(str(tmp_path / "model.safetensors"))
    assert loaded["absmax"].tolist() == [1.5, 2.5] and loaded["absmax"].dtype == torch.float32
    assert loaded["shape"].tolist() == [7, 9] and loaded["packed"].tolist() == [0, 1, 2]
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert f.get_slice("absmax")[1:].tolist() == [2.5]


def test_empty_index_is_refused(tmp_path):
    write_one(tmp_path / "model.safetensors")
    write_index(tmp_path, {})
    with pytest.raises(FormatError, match="empty"):
        open_checkpoint(tmp_path)


def test_a_file_cut_short_after_opening_is_reported_on_read(tmp_path):
    write_one(tmp_path / "model.safetensors", {"a": np.arange(1024, dtype=np.float32)})
    checkpoint = open_checkpoint(tmp_path)
    raw = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(raw[:-100])
    with pytest.raises(FormatError, match="model.safetensors"):
        checkpoint.get("a")
