"""The GPU kernel variants a plan can name, and the tuned table (kernels/gpu_tuned.json) that picks one per shape.

Variants: "tiled" (gpu_dense's kernels, the default), "splitk", "swapab" and
"gemv" (gpu_decode), "pipelined" (gpu_prefill's Triton kernel) and "xla"
(XLA's own dot on the prepared weight). bench/gpu_tune.py times them on a GPU
and writes the winners, one entry per operation, M bucket and (K, N); a plan
on backend "gpu" takes the entry of its operation and (K, N) whose M is the
smallest at or above the problem's M (the largest, past every bucket), when
its tiling fits the problem; otherwise the tile table's "tiled" choice stands.
No file (no GPU has tuned this checkout) means no entries.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

from qconvert.kernels.tiles import Tiling

VARIANTS = ("tiled", "splitk", "swapab", "gemv", "pipelined", "xla")
TUNED_PATH = Path(__file__).with_name("gpu_tuned.json")
# The dense operations the variants serve, and the variants the grouped (MoE) forward has besides its tiled one.
VARIANT_OPS = ("int8_matmul", "fp8_matmul", "int8_weight_matmul", "nf4_matmul", "int4_weight_matmul")
GROUPED_VARIANTS = ("tiled", "gemv")


@dataclasses.dataclass(frozen=True)
class Variant:
    """A kernel variant and its launch knobs: K ranges (split), warps, pipeline stages, swizzle group."""

    name: str = "tiled"
    split: int = 1
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8

    def __post_init__(self):
        if self.name not in VARIANTS:
            raise ValueError(f"unknown GPU kernel variant {self.name!r}; choose one of {', '.join(VARIANTS)}")
        if self.split < 1 or self.split & (self.split - 1):
            raise ValueError(f"split must be a power of two >= 1, got {self.split}")

    def __str__(self) -> str:
        if self.name in ("tiled", "xla"):
            return self.name
        text = f"{self.name} warps={self.num_warps} stages={self.num_stages}"
        if self.name in ("splitk", "swapab", "gemv"):
            text += f" split={self.split}"
        return text + (f" group_m={self.group_m}" if self.name == "pipelined" else "")

    def as_json(self) -> dict:
        return dataclasses.asdict(self)


def entry_key(op: str, k: int, n: int) -> str:
    """A tuned entry's key: the operation (grouped ones as "grouped_matmul/<rhs kind>") and (K, N)."""
    return f"{op} {k}x{n}"


def load_tuned(path: str | None = None) -> dict[str, list[tuple[int, Variant, Tiling]]]:
    """The tuned table at `path` (TUNED_PATH by default): entry_key -> [(M, variant, tiling)] sorted by M;
    {} when there is no file."""
    return _load_tuned(str(TUNED_PATH if path is None else path))


@functools.lru_cache(maxsize=4)
def _load_tuned(path: str) -> dict[str, list[tuple[int, Variant, Tiling]]]:
    try:
        document = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return {}
    table: dict[str, list[tuple[int, Variant, Tiling]]] = {}
    for entry in document["entries"]:
        choice = (int(entry["m"]), Variant(**entry["variant"]), Tiling(*entry["tiling"]))
        table.setdefault(entry_key(entry["op"], entry["k"], entry["n"]), []).append(choice)
    for choices in table.values():
        choices.sort(key=lambda c: c[0])
    return table


def tuned_choice(op: str, m: int, k: int, n: int, path: str | None = None) -> tuple[Variant, Tiling] | None:
    """The tuned (variant, tiling) for a dense problem, or None where the table has no entry for its (K, N)."""
    choices = load_tuned(path).get(entry_key(op, k, n))
    if not choices:
        return None
    for bucket, variant, tiling in choices:
        if m <= bucket:
            return variant, tiling
    return choices[-1][1], choices[-1][2]


def write_tuned(path: Path, device: str, entries: list[dict]) -> None:
    """Write a tuned table: entries of {op, m, k, n, variant (Variant.as_json), tiling [tm, tk, tn], us}."""
    document = {"device": device, "entries": sorted(entries, key=lambda e: (e["op"], e["k"], e["n"], e["m"]))}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(document, indent=1) + "\n")
    tmp.replace(path)
    _load_tuned.cache_clear()
