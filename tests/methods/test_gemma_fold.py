"""Gemma's SmoothQuant fold: the gain its bf16 norm stores, (1 + w) / s - 1 near -1, is rounded coarsely; the
linears' columns take what the stored gain carries, so the smoothed float model keeps the source's gains."""

import json
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from cli_helpers import run
from gemma_checkpoints import GEMMA2, make_gemma_checkpoint, with_outlier_channels

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))


@pytest.fixture(scope="module")
def outlier_gemma(tmp_path_factory):
    return with_outlier_channels(make_gemma_checkpoint(tmp_path_factory.mktemp("fold") / "gemma", GEMMA2))


def _options():
    from qconvert.options import ConvertOptions, CalibrationOptions

    return ConvertOptions(scheme="w8a8", calibration=CalibrationOptions(calib="random", calib_samples=4, calib_seqlen=16,
                                                          alpha="family"))


def test_the_smoothed_gemma_applies_the_source_gains_to_float32_rounding(outlier_gemma, monkeypatch):
    import qconvert.methods.group_scales
    from gemma_fold import gain_errors
    from qconvert.source.resolve import open_source, resolve_source

    source = open_source(resolve_source(str(outlier_gemma)))
    try:
        after, largest = gain_errors(source, _options())
        monkeypatch.setattr(qconvert.methods.group_scales, "stored_gain_scales", lambda scales, weight: scales)
        before, _ = gain_errors(source, _options())
    finally:
        source.close()
    assert max(largest.values()) > 5  # the outlier channels make s large
    # s folded on both sides: the bf16 rounding of the stored gain shows, about s * 2^-9 at worst.
    assert 1e-3 < max(e.max() for e in before.values()) <= max(largest.values()) * 2.0 ** -9 * 1.01
    assert max(e.max() for e in after.values()) < 1e-6


def test_an_s_the_stored_gain_cannot_carry_is_capped():
    from qconvert.models.family import SmoothingGroup
    from qconvert.methods.fold import MIN_GAIN_STEPS, GroupScales, apply_fold, stored_gain_scales, tensor_folds

    group = SmoothingGroup("n", ("q",), norm_offset=1.0)
    w = np.array([0.0, 0.5, -0.5, 2.0], np.float32).astype(ml_dtypes.bfloat16)
    s = np.array([1e6, 3.0, 1e4, 1.0], np.float32)
    scales = stored_gain_scales(GroupScales(group, 0.5, s, s), w)
    gain = w.astype(np.float32) + 1
    # bf16 steps just inside -1 are 2^-8: at least MIN_GAIN_STEPS of them stay in the stored gain.
    np.testing.assert_allclose(scales.source_scales, [min(1e6, g * 2.0 ** 8 / MIN_GAIN_STEPS) if s_ > 100 else s_
                                                      for g, s_ in zip(gain, s)], rtol=1e-6)
    stored = apply_fold(w, tensor_folds([scales])["n.weight"]).astype(np.float32) + 1
    assert np.all(stored > 0)
    np.testing.assert_allclose(stored * scales.input_scales, gain, rtol=1e-6)


def test_the_outlier_gemma_converts_and_verifies(outlier_gemma, tmp_path, capsys):
    out = tmp_path / "out"
    assert run(["quantize", str(outlier_gemma), "-o", str(out), "--scheme", "w8a8", "--calib", "random",
                "--calib-samples", "4", "--calib-seqlen", "16", "-q"], capsys)[0] == 0
    exit_code, stdout, _ = run(["verify", str(out), "--quick", "--json", "-"], capsys)
    assert exit_code == 0, json.loads(stdout)["integrity"]
