"""Conversion on several threads: the same bytes as one thread, row blocks equal to whole tensors, bounded work."""

import hashlib
import json
import random
import threading
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

import qconvert.schemes.rowwise as rowwise
from checkpoints import make_llama_checkpoint
from quantize_reference import numpy_int8, numpy_nf4, unpack_int32_words
from qconvert.convert import ConvertOptions, convert
from qconvert.options import CalibrationOptions
from qconvert.formats.errors import UsageError
from qconvert.formats.safetensors_io import TensorSpec, open_checkpoint, write_shards
from qconvert.write.prefetch import available_cores, run_ahead
from qconvert.schemes import scheme_named


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def read_all(folder: Path) -> dict[str, np.ndarray]:
    tensors = {}
    for shard in folder.glob("*.safetensors"):
        tensors.update(load_file(str(shard)))
    return tensors


@pytest.fixture(scope="module")
def sharded_llama(tmp_path_factory):
    # Real hidden/intermediate sizes, shrunk elsewhere; three input shards.
    return make_llama_checkpoint(tmp_path_factory.mktemp("parallel") / "src", hidden=576, intermediate=1536,
                                 heads=9, kv_heads=3, layers=2, vocab=512, shards=3, dtype="bfloat16")


@pytest.mark.parametrize("scheme,double_quant", [("int8", False), ("nf4", True), ("w8a8", False)])
def test_one_worker_and_many_write_the_same_bytes(sharded_llama, tmp_path, monkeypatch, scheme, double_quant):
    # Blocks of a few rows, so every linear is read and quantized in many pieces on the threads.
    monkeypatch.setattr(rowwise, "BLOCK_BYTES", 20_000)
    # w8a8 without smoothing or searches: its linears take the same row-block path as int8's.
    plain = {"scale_search": False, "gptq": False, "calibration": CalibrationOptions(smooth=False)} if scheme == "w8a8" else {}
    outs = {}
    for workers in (1, 4):
        outs[workers] = tmp_path / f"out{workers}"
        convert(str(sharded_llama), outs[workers], ConvertOptions(
            scheme=scheme, double_quant=double_quant, max_shard_size=1_000_000, workers=workers, **plain))
    one, many = folder_bytes(outs[1]), folder_bytes(outs[4])
    assert len([name for name in one if name.endswith(".safetensors")]) > 2
    assert one == many
    # And they are right, not merely alike: the numpy reference of one linear.
    src, dst = read_all(sharded_llama), read_all(outs[4])
    name = "model.layers.1.mlp.down_proj.weight"
    module = name.removesuffix(".weight")
    if scheme == "nf4":
        packed, _ = numpy_nf4(src[name])
        np.testing.assert_array_equal(dst[name].reshape(-1), packed)
    else:
        codes, scale = numpy_int8(src[name], ml_dtypes.bfloat16)
        got = dst[f"{module}.weight"] if scheme == "w8a8" else unpack_int32_words(
            dst[f"{module}.weight_packed"], src[name].shape[1])
        np.testing.assert_array_equal(got, codes)
        np.testing.assert_array_equal(dst[f"{module}.weight_scale"], scale)


@pytest.mark.parametrize("shape", [(37, 576), (129, 768), (5, 100), (64, 896), (3, 3)])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16])
def test_row_blocks_give_the_numpy_reference_codes(monkeypatch, shape, dtype):
    monkeypatch.setattr(rowwise, "BLOCK_BYTES", 3_000)
    rng = np.random.default_rng(sum(shape))
    w = (rng.standard_normal(shape) * 0.05).astype(dtype)
    w[1, :] = 0  # an all-zero row (int8) and blocks (NF4)
    reads = []

    def read_rows(start, stop):
        reads.append((start, stop))
        return w[start:stop].copy()

    int8, nf4 = scheme_named("int8"), scheme_named("nf4")
    q = int8.quantize_rows(read_rows, shape, w.dtype, int8.layout_flags())
    codes, scale = numpy_int8(w, w.dtype)
    np.testing.assert_array_equal(q.qvalue, codes)
    np.testing.assert_array_equal(q.scale, scale)
    assert shape[0] < 8 or len(reads) > 1
    q = nf4.quantize_rows(read_rows, shape, w.dtype, nf4.layout_flags())
    packed, absmax = numpy_nf4(w)
    np.testing.assert_array_equal(q.qvalue, packed)
    np.testing.assert_array_equal(q.scale, absmax)


def test_nf4_row_blocks_hold_whole_blocks_and_bytes():
    for cols in (100, 576, 896, 3, 4096, 128256):
        rows = rowwise.block_rows(10**7, cols, 2, 128)
        assert rows * cols % 128 == 0 and rows * cols * 2 <= max(rowwise.BLOCK_BYTES, 128 * cols * 2)
    assert rowwise.block_rows(7, 576, 2, 128) == 7  # one block: the whole weight


def test_get_rows_reads_exactly_those_rows(sharded_llama):
    ckpt = open_checkpoint(sharded_llama)
    whole = read_all(sharded_llama)
    for name in ("model.embed_tokens.weight", "model.layers.1.mlp.up_proj.weight", "model.norm.weight"):
        rows = whole[name].shape[0]
        for start, stop in ((0, rows), (3, 17), (rows - 1, rows), (5, 5)):
            np.testing.assert_array_equal(ckpt.get_rows(name, start, stop), whole[name][start:stop])
        with pytest.raises(ValueError):
            ckpt.get_rows(name, 0, rows + 1)
    ckpt.close()


def test_the_streaming_writer_hashes_what_it_wrote(tmp_path):
    rng = np.random.default_rng(3)
    arrays = {"a": rng.standard_normal((700, 600)).astype(np.float32), "b": np.arange(5, dtype=np.int64),
              "c": rng.integers(0, 255, (3 << 20,), dtype=np.uint8)}
    specs = [TensorSpec(n, a.dtype, a.shape) for n, a in arrays.items()]
    hashes = write_shards(tmp_path, specs, iter(arrays.items()), max_shard_size=2_000_000)
    assert len(hashes) == 3  # two shards and the index
    for name, digest in hashes.items():
        assert hashlib.sha256((tmp_path / name).read_bytes()).hexdigest() == digest
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    for name, array in arrays.items():
        np.testing.assert_array_equal(load_file(str(tmp_path / index["weight_map"][name]))[name], array)


def test_many_workers_give_results_in_task_order_within_the_byte_limit():
    rng = random.Random(1)
    costs = [rng.choice([5, 10, 20, 60]) for _ in range(60)]
    delays = [rng.uniform(0, 0.003) for _ in costs]
    limit, lock, held, peaks, running, most_running = 60, threading.Lock(), [0], [], [0], [0]

    def task(i):
        def run():
            with lock:
                running[0] += 1
                most_running[0] = max(most_running[0], running[0])
            time.sleep(delays[i])
            with lock:
                running[0] -= 1
            return [(i, k) for k in range(i % 2 + 1)]
        return run

    def tasks():
        for i, cost in enumerate(costs):
            with lock:
                held[0] += cost
                peaks.append((held[0], cost))
            yield cost, task(i)

    out = []
    for item in run_ahead(tasks(), limit_bytes=limit, workers=4):
        out.append(item)
        if item[1] == item[0] % 2:  # the task's last result: the consumer lets its bytes go next
            with lock:
                held[0] -= costs[item[0]]
    assert out == [(i, k) for i in range(len(costs)) for k in range(i % 2 + 1)]
    # A task is drawn only once the ones before it fit within the limit.
    assert all(total - cost <= limit for total, cost in peaks)
    assert most_running[0] > 1
    assert [t for t in threading.enumerate() if t.name == "qconvert-prefetch"] == []


def test_an_error_on_one_of_many_workers_comes_after_the_results_before_it():
    def task(i):
        def run():
            time.sleep(0.001 * (i % 3))
            if i == 7:
                raise ValueError("bad tensor")
            return [i]
        return run

    seen = []
    with pytest.raises(ValueError, match="bad tensor"):
        for item in run_ahead(((1, task(i)) for i in range(30)), limit_bytes=4, workers=3):
            seen.append(item)
    assert seen == list(range(7))
    assert [t for t in threading.enumerate() if t.name == "qconvert-prefetch"] == []


def test_workers_must_be_a_positive_count():
    assert available_cores() >= 1
    for bad in (0, -2, 1.5, True):
        with pytest.raises(UsageError, match="--workers"):
            ConvertOptions(workers=bad)


def test_cli_workers_zero_is_a_usage_error_and_a_count_writes_the_default_bytes(sharded_llama, tmp_path, capsys):
    from qconvert.cli.main import main

    def run(argv):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        return exit_info.value.code, capsys.readouterr().err

    code, err = run(["quantize", str(sharded_llama), "-o", str(tmp_path / "zero"), "--workers", "0"])
    assert code == 2 and "--workers" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "zero").exists()
    assert run(["quantize", str(sharded_llama), "-o", str(tmp_path / "three"), "--workers", "3", "-q"])[0] == 0
    assert run(["quantize", str(sharded_llama), "-o", str(tmp_path / "default"), "-q"])[0] == 0
    assert folder_bytes(tmp_path / "three") == folder_bytes(tmp_path / "default")


@pytest.mark.parametrize("dtype,uint", [(np.float32, np.uint32), (np.float16, np.uint16),
                                        (ml_dtypes.bfloat16, np.uint16)])
def test_the_float_tensor_check_agrees_with_isfinite_on_every_kind_of_bit_pattern(dtype, uint):
    from qconvert.write.tensors import all_finite

    rng = np.random.default_rng(7)
    bits = rng.integers(0, np.iinfo(uint).max, 5000, dtype=uint, endpoint=True)
    values = bits.view(dtype)
    for chunk in range(0, values.size, 50):
        part = values[chunk:chunk + 50]
        expected = bool(np.isfinite(part.astype(np.float64)).all())
        assert all_finite(part, chunk_elements=16) == expected
    finite = values[np.isfinite(values.astype(np.float64))]
    assert all_finite(finite, chunk_elements=16) and finite.size > 1000


@pytest.mark.parametrize("workers", ["13", "1000000"])
def test_workers_above_four_per_core_exit_2_with_one_line(sharded_llama, tmp_path, capsys, monkeypatch, workers):
    from cli_helpers import run, tree

    import qconvert.write.prefetch

    monkeypatch.setattr(qconvert.write.prefetch, "available_cores", lambda: 3)
    before = tree(tmp_path)
    exit_code, stdout, stderr = run(["quantize", str(sharded_llama), "-o", str(tmp_path / "out"),
                                     "--workers", workers], capsys)
    assert (exit_code, stdout) == (2, "")
    assert stderr == (f"qconvert: error: --workers {workers} is more than 4 threads per core (12 on this "
                      "machine's 3 cores); give at most 12\n")
    assert tree(tmp_path) == before


def test_workers_of_four_per_core_are_taken(monkeypatch):
    import qconvert.write.prefetch

    monkeypatch.setattr(qconvert.write.prefetch, "available_cores", lambda: 3)
    assert ConvertOptions(workers=12).workers == 12
