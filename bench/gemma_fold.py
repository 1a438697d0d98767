"""The gain a Gemma norm applies after SmoothQuant's fold, against the one intended: before and after
folding what the stored bf16 gain carries (qconvert.methods.smooth.stored_gain_scales).

    python bench/gemma_fold.py

A tiny bf16 Gemma 2 with two outlier channels in its residual stream
(tests/gemma_checkpoints.py) is calibrated on random ids (w8a8, the family's
alpha). For every norm -> linears group the figure is the relative error of the
gain the smoothed model applies per channel, (1 + w'_stored) * s_columns, against
the source's 1 + w: "before" folds s into both sides, "after" is qconvert's.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from gemma_checkpoints import GEMMA2, make_gemma_checkpoint, with_outlier_channels  # noqa: E402


def gain_errors(source, options) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """{norm: relative error per channel} of the gain the smoothed float model applies, and {norm: max s}."""
    from qconvert.methods.fold import apply_fold
    from qconvert.methods.recipe import prepare_adjustments

    adjustments = prepare_adjustments(source, options)
    errors, largest = {}, {}
    for group in source.model.smoothing_groups():
        if not group.norm_offset:
            continue
        norm = np.asarray(source.params[f"{group.source}.weight"])
        stored = apply_fold(norm, adjustments.folds[f"{group.source}.weight"]).astype(np.float32)
        columns = adjustments.folds[f"{group.linears[0]}.weight"].col_multiplier
        gain = norm.astype(np.float32) + group.norm_offset
        errors[group.source] = np.abs((stored + group.norm_offset) * columns - gain) / np.abs(gain)
        largest[group.source] = float(np.max(adjustments.folds[f"{group.source}.weight"].row_divisor))
    return errors, largest


def main() -> None:
    import qconvert.methods.smoothquant
    from qconvert.options import ConvertOptions, CalibrationOptions
    from qconvert.source.resolve import open_source, resolve_source

    with tempfile.TemporaryDirectory() as tmp:
        folder = with_outlier_channels(make_gemma_checkpoint(Path(tmp) / "gemma", GEMMA2))
        options = ConvertOptions(scheme="w8a8", calibration=CalibrationOptions(calib="random", calib_samples=8, calib_seqlen=32,
                                                                  alpha="family"))
        source = open_source(resolve_source(str(folder)))
        after, _ = gain_errors(source, options)
        fold_for_real = qconvert.methods.smoothquant.stored_gain_scales
        qconvert.methods.smoothquant.stored_gain_scales = lambda scales, weight: scales  # s on both sides, as before
        try:
            before, largest = gain_errors(source, options)
        finally:
            qconvert.methods.smoothquant.stored_gain_scales = fold_for_real
        source.close()
    print(f"{'norm':42} {'max s':>7} {'before: max':>12} {'median':>10} {'after: max':>12}")
    for name in sorted(before):
        print(f"{name:42} {largest[name]:7.1f} {before[name].max():12.3e} {np.median(before[name]):10.3e} "
              f"{after[name].max():12.3e}")
    print(f"{'all':42} {max(largest.values()):7.1f} {max(e.max() for e in before.values()):12.3e} "
          f"{np.median(np.concatenate(list(before.values()))):10.3e} {max(e.max() for e in after.values()):12.3e}")


if __name__ == "__main__":
    main()
