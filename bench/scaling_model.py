"""The time and memory model of a calibrating conversion (docs/SCALING.md), as a table.

    python bench/scaling_model.py [--check]

Per layer, a conversion with GPTQ does (T calibration tokens, D devices over p processes):

  forward    2 P T FLOP (P: the layer's linear parameters; for MoE, the active ones per token), twice with GPTQ
             (the float pass that observes, and the re-run on the rounded weights): split over the D devices
  Hessians   2 T sum(in^2) FLOP over the distinct inputs (q/k/v, o, gate/up, down; per expert its routed
             tokens): split over the D devices
  GPTQ       per group of linears sharing an input, 2 rows in^2 (the column loop) + 4/3 in^3 (factor and
             inverse): groups spread over the devices, the largest first; a group that costs more than an even
             share of the layer (and has 64 rows a device) is split by rows over every device instead
             (qconvert.methods.gptq_rows.split_groups): its factor on one device, its loop over all, its output
             error on the whole (4 rows in^2 at the forward's rate); a layer waits for the spread groups, then
             the split ones
  gathers    every process receives the layer's outputs (T h 4 bytes, twice with GPTQ), the layer's summed
             Hessians once (sum(in^2) 4 bytes) and every rounded weight (5 bytes a parameter); each device
             sends and receives about one layer's Hessians per group of batches it runs (b / D groups of b
             batches) while they are summed in batch order, a block of rows on each device
  read       every process reads the whole checkpoint; write: process 0 writes the output

The device rates are the ones measured: `--check` prints the model's figures beside the measured ones
(docs/BENCHMARKS.md: the 8B shape on an H200, and bench/distributed.py on the 2-core CPU host).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qconvert.methods.gptq_rows import split_groups  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    layers: int
    hidden: int
    intermediate: int          # dense MLP width (MoE: each expert's)
    kv: int                    # k/v projection width
    experts: int = 0           # routed experts per MoE layer (0: dense)
    active: int = 0            # experts per token
    shared: int = 0            # shared experts' total width
    dense_layers: int = 0      # MoE models: leading dense layers
    dense_intermediate: int = 0
    params_b: float = 0.0      # total parameters (billions), for the read and write terms


MODELS = [
    Model("Llama-3-8B", 32, 4096, 14336, 1024, params_b=8.0),
    Model("Llama-3-70B", 80, 8192, 28672, 1024, params_b=70.6),
    Model("Llama-3.1-405B", 126, 16384, 53248, 1024, params_b=405.8),
    # DeepSeek-V3: MLA attention approximated as q/k/v/o of widths 7168 -> (1536 + 24576), 512 + 64 -> 32768.
    Model("DeepSeek-V3-671B", 61, 7168, 2048, 1024, experts=256, active=8, shared=2048, dense_layers=3,
          dense_intermediate=18432, params_b=671.0),
]


@dataclasses.dataclass(frozen=True)
class Device:
    name: str
    flops: float        # effective float32 rate of the calibration's forward and Hessians, and of GPTQ's
    #                     factorization (blocked Cholesky and triangular solve: matrix products) (FLOP/s)
    solve_flops: float  # effective rate of GPTQ's column loop (FLOP/s)
    memory: float       # bytes
    link: float         # bytes/s a process receives in the gathers (between hosts)


# Rates from the H200 measurements (docs/BENCHMARKS.md, "The 8B shape on an H200": 3.2 s a layer of forward and
# statistics, 8.2 s a layer of GPTQ with its re-run): the factorization taken at the forward's rate, the column
# loop fitted to the rest (H200_LOOP_FLOPS); the H100 scaled by its memory bandwidth (3.35 / 4.8 TB/s), the v5e
# by its float32 matrix rate (about 1/3 of the H100's effective one through bf16 passes).
H200_FLOPS, H200_GPTQ_LAYER_S = 19.4e12, 8.2


def fitted_loop_flops() -> float:
    """The H200's column-loop rate that makes the 8B layer's GPTQ with its re-run take the measured 8.2 s (the
    factorizations and the output errors, 4 rows in^2 a group, at the forward's rate)."""
    forward, _, groups, _ = layer_work(MODELS[0], False)
    at_forward_rate = sum(4 / 3 * width ** 3 + 4 * rows * width ** 2 for rows, width in groups) / H200_FLOPS
    loop = sum(2 * rows * width ** 2 for rows, width in groups)
    return loop / (H200_GPTQ_LAYER_S - forward / H200_FLOPS - at_forward_rate)


TOKENS, SEQLEN, BATCH = 128 * 512, 512, 8
READ_BPS, WRITE_BPS = 2e9, 1e9  # a process's checkpoint read, process 0's write (bytes/s)


def layer_work(m: Model, moe: bool) -> tuple[float, float, list[tuple[int, int]], float]:
    """(forward FLOP, Hessian FLOP, GPTQ's groups as (rows, input width), weight parameters) of one layer."""
    h, t = m.hidden, TOKENS
    attention = h * (h + 2 * m.kv) + h * h
    hess = 2 * t * (3 * h * h)                    # q/k/v's, o's and gate/up's inputs (width h)
    groups = [(h + 2 * m.kv, h), (h, h)]
    if moe:
        f, e = m.intermediate, m.experts
        routed = t * m.active / e                 # tokens per expert
        active = attention + 3 * h * (m.active * f + m.shared)
        weights = attention + 3 * h * (e * f + m.shared)
        hess = 2 * t * 2 * h * h + e * 2 * routed * (h * h + f * f) + 2 * t * (h * h + m.shared ** 2)
        groups += [(2 * f, h)] * e + [(h, f)] * e + [(2 * m.shared, h), (h, m.shared)]
        forward = 2 * active * t
    else:
        f = m.dense_intermediate or m.intermediate
        weights = attention + 3 * h * f
        hess += 2 * t * f * f
        groups += [(2 * f, h), (h, f)]
        forward = 2 * weights * t
    return forward, hess, groups, weights


def hessian_bytes(m: Model, moe: bool) -> float:
    h = m.hidden
    if moe:
        return 4 * (2 * h * h + m.experts * (h * h + m.intermediate ** 2) + h * h + m.shared ** 2)
    f = m.dense_intermediate or m.intermediate
    return 4 * (3 * h * h + f * f)


def layer_peak(m: Model, moe: bool, devices: int, split: bool, batch: int = 0) -> float:
    """Bytes on each device while a layer calibrates: its weights (bf16), every sample's hidden states (in and
    out, float32) and its Hessians; with the experts split (--shard-experts), ceil(E / D) experts' weights and
    Hessians a device, beside every device's routed rows of a group (two batches in flight) of `batch` windows
    (default BATCH)."""
    _, _, _, weights = layer_work(m, moe)
    hidden, hessians = 2 * TOKENS * m.hidden * 4, hessian_bytes(m, moe)
    if not split:
        return 2 * weights + hidden + hessians
    share = -(-m.experts // devices) / m.experts
    expert_weights = 3 * m.hidden * m.experts * m.intermediate
    expert_hessians = expert_hessian_bytes(m)
    return (2 * (weights - (1 - share) * expert_weights) + hidden + hessians - (1 - share) * expert_hessians
            + 2 * routed_rows_bytes(m, devices, batch or BATCH))


def expert_hessian_bytes(m: Model) -> float:
    """A MoE layer's routed experts' Hessians (gate/up's input, down's), float32."""
    return 4 * m.experts * (m.hidden ** 2 + m.intermediate ** 2)


def split_batch(m: Model, dev: Device, devices: int) -> int:
    """The windows a batch with the experts split: the most up to BATCH whose peak fits (calibration lowers the
    batch so: calibration.memory.fit_batch_size), at least 1."""
    return next((b for b in range(BATCH, 0, -1) if layer_peak(m, True, devices, True, b) <= dev.memory), 1)


def routed_rows_bytes(m: Model, devices: int, batch: int = BATCH) -> float:
    """One group's routed rows on each device with the experts split: every device's batch, each token's
    `active` rows, in and out of gate/up (h, f) and down (f, h), float32."""
    return devices * batch * SEQLEN * m.active * (2 * m.hidden + 2 * m.intermediate) * 4


def splits_experts(m: Model, dev: Device, devices: int, moe: bool) -> bool:
    """--shard-experts auto: a MoE layer with every expert does not fit one device, and there are several."""
    return moe and devices > 1 and layer_peak(m, moe, devices, False) > dev.memory


H200 = Device("H200", H200_FLOPS, fitted_loop_flops(), 141e9, 50e9)
DEVICES = [Device("H100", 13.5e12, 0.70 * H200.solve_flops, 80e9, 50e9),
           Device("TPU v5e", 4.5e12, H200.solve_flops / 3, 16e9, 25e9)]


def spread(costs: list[float], devices: int) -> float:
    """The largest device's load when `costs` are bin-packed the largest first."""
    load = [0.0] * devices
    for c in sorted(costs, reverse=True):
        load[load.index(min(load))] += c
    return max(load)


def gptq_seconds(groups: list[tuple[int, int]], dev: Device, devices: int, rows_split: bool = True) -> float:
    """A layer's GPTQ: the groups qconvert keeps whole spread over the devices, then each split one (its factor
    on one device, its loop over all, its output error on the whole group)."""
    costs = [float(rows * width ** 2 + width ** 3) for rows, width in groups]  # gptq._cost
    split = split_groups(costs, [rows for rows, _ in groups], devices) if rows_split else [False] * len(groups)

    def alone(rows: int, width: int) -> float:
        return 2 * rows * width ** 2 / dev.solve_flops + (4 / 3 * width ** 3 + 4 * rows * width ** 2) / dev.flops

    whole = spread([alone(*g) for g, s in zip(groups, split) if not s], devices)
    return whole + sum(4 / 3 * width ** 3 / dev.flops + 2 * rows * width ** 2 / (devices * dev.solve_flops)
                       + 4 * rows * width ** 2 / dev.flops for (rows, width), s in zip(groups, split) if s)


def predict(m: Model, dev: Device, devices: int, per_host: int = 8, rows_split: bool = True) -> dict[str, float]:
    processes = max(1, devices // per_host)
    seconds = {"forward": 0.0, "gptq": 0.0, "gathers": 0.0}
    peak, split_any = 0.0, False
    for moe, count in ((False, m.dense_layers if m.experts else m.layers), (True, m.layers - m.dense_layers
                                                                            if m.experts else 0)):
        if not count:
            continue
        forward, hess, groups, weights = layer_work(m, moe)
        seconds["forward"] += count * (2 * forward + hess) / (devices * dev.flops)
        seconds["gptq"] += count * gptq_seconds(groups, dev, devices, rows_split)
        batches = TOKENS // (SEQLEN * BATCH)
        groups_run = -(-batches // devices)  # the Hessians' ordered sum: an all-to-all per group of batches
        split = splits_experts(m, dev, devices, moe)
        hessians = hessian_bytes(m, moe)
        if split:  # the experts' Hessians stay with their owners until the layer's end: gathered once; every
            # group gathers its routed rows to every device instead
            experts = expert_hessian_bytes(m)
            rows = TOKENS * m.active * (2 * m.hidden + 2 * m.intermediate) * 4  # every token's, to each
            moved = (groups_run + 1) * (hessians - experts) + experts + rows
        else:
            moved = (groups_run + 1) * hessians
        gathered = 2 * TOKENS * m.hidden * 4 + moved + 5 * weights
        if devices > 1:
            link = dev.link if processes > 1 else 25e9  # one host: device to host
            seconds["gathers"] += count * gathered / link
        peak = max(peak, layer_peak(m, moe, devices, split, split_batch(m, dev, devices) if split else 0))
        split_any = split_any or split
    seconds["read"] = m.params_b * 2e9 / READ_BPS
    seconds["write"] = m.params_b * 0.6e9 / WRITE_BPS  # int4 with scales, about 0.6 bytes a parameter
    seconds["total"] = sum(seconds.values())
    seconds["peak_gb"] = peak / 1e9
    seconds["split"] = split_any
    return seconds


def table() -> str:
    lines = ["| model | device | devices | forward | GPTQ | gathers | read + write | total | one device / this |"
             " peak per device |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for m in MODELS:
        for dev in DEVICES:
            one = predict(m, dev, 1)["total"]
            for devices in (1, 8, 32):
                p = predict(m, dev, devices)
                fits = "" if p["peak_gb"] * 1e9 <= dev.memory else " (does not fit)"
                fits += ", experts split" if p.get("split") else ""
                lines.append(f"| {m.name} | {dev.name} | {devices} | {p['forward'] / 60:.0f} min | "
                             f"{p['gptq'] / 60:.0f} min | {p['gathers'] / 60:.0f} min | "
                             f"{(p['read'] + p['write']) / 60:.0f} min | {p['total'] / 60:.0f} min | "
                             f"{one / p['total']:.1f}x | {p['peak_gb']:.0f} GB{fits} |")
    return "\n".join(lines)


def check() -> str:
    """The model's per-layer figures for the 8B shape on the H200 beside the measured ones."""
    m = MODELS[0]
    forward, hess, groups, _ = layer_work(m, False)
    observe = (forward + hess) / H200.flops
    gptq = gptq_seconds(groups, H200, 1) + forward / H200.flops
    down = gptq_seconds(groups[-1:], H200, 1) / gptq_seconds(groups, H200, 1)
    factor = sum(4 / 3 * width ** 3 for _, width in groups) / H200.flops / gptq_seconds(groups, H200, 1)
    return (f"8B shape, one H200, a layer: forward + statistics {observe:.1f} s (measured 3.2 s: w8a8 without "
            f"GPTQ, 70.6 s fixed part apart); GPTQ with its re-run {gptq:.1f} s (measured 8.2 s: int4 with GPTQ "
            f"11.4 s a layer minus 3.2 s; the column loop fitted at {H200.solve_flops / 1e12:.2f} TFLOP/s, the "
            f"factorization taken at the forward's {H200.flops / 1e12:.1f}); down_proj's group is {down:.0%} of "
            f"GPTQ's solve, the factorizations {factor:.0%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    opts = parser.parse_args()
    print(check() if opts.check else table())


if __name__ == "__main__":
    main()
