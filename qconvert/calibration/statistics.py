"""Calibration statistics as objects: what each observes in a layer, how it sums over batches, what it holds.

A step asks for the statistics it needs (`Step.statistics()`); the observer computes exactly those and the
engine (calibration/layers.py) sums them without knowing any by name. A statistic says:

- `site`: what it observes: a linear's input ("input") or output ("output"), or an attention block's keys
  and values after RoPE, as the KV cache stores them ("attention");
- `modules`: which of them (layer-relative names are compared, so every layer that shares a compiled
  program decides alike); None: every one;
- `observe(name, x, valid, run)`: inside the compiled layer, one batch's arrays, split in two: `listed`
  entries (one per batch, to the host) and `summed` entries, which the engine adds on the device in batch
  order (a scalar or a square matrix: the same floats on any mesh);
- `values(observed)`: on the host, once every batch has passed, each module's value;
- `held_on_device`: whether it holds an [in, in] sum per module on the device while a layer runs, which
  the memory estimate counts (calibration/memory.py: GPTQ's Hessian term, with its copies per device).

Statistics of one kind asked for by several steps merge (`merged`): the union of their modules.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from qconvert.formats.errors import InvalidWeightError

INPUT, OUTPUT, ATTENTION = "input", "output", "attention"
SAMPLE_ROWS = 512  # tokens kept per linear input for the alpha and scale searches

_LAYER_INDEX = re.compile(r"\.[0-9]+\.")


def layer_relative(name: str) -> str:
    """A module name with its layer index replaced by '#' (the first '.<digits>.' component).

    Layers that share a compiled program see one representative layer's names;
    what the observer keeps must be decided alike for every layer.
    """
    return _LAYER_INDEX.sub(".#.", name, count=1)


@dataclasses.dataclass(frozen=True)
class RunShape:
    """What a statistic may need to know of the run it observes: batches per layer."""

    batches: int


@dataclasses.dataclass(frozen=True)
class Observed:
    """One module's observations of one statistic: the listed entries per batch (on the host) and the summed
    entries (added over every batch in batch order, still on the device), or None."""

    listed: list[dict[str, Any]]
    summed: dict[str, Any] | None


@dataclasses.dataclass(frozen=True)
class Statistic:
    """The base: a statistic of `site` for `modules` (None: every one). Subclasses define what it computes."""

    modules: frozenset[str] | None = None
    site = INPUT
    key = ""
    held_on_device = False  # whether it holds an [in, in] sum per module on the device (the memory estimate's)

    def wants(self, relative: str) -> bool:
        """Whether the module (layer-relative name) is observed by this statistic."""
        return self.modules is None or relative in self._relative

    def asked(self, name: str) -> bool:
        """Whether module `name` itself was asked for: a layer that shares another's program observes what that
        one asks for, and a statistic that keeps much per module keeps only the modules asked for."""
        return self.modules is None or name in self.modules

    @property
    def _relative(self) -> frozenset[str]:
        return frozenset(layer_relative(m) for m in self.modules or ())

    def merged(self, other: "Statistic") -> "Statistic":
        """This statistic over both requests' modules."""
        if self.modules is None or other.modules is None:
            return dataclasses.replace(self, modules=None)
        return dataclasses.replace(self, modules=self.modules | other.modules)

    def begin(self) -> "Statistic":
        """The statistic as one run uses it (a fresh copy where it keeps state while tracing)."""
        return self

    def observe(self, name: str, x: jax.Array, valid: jax.Array, run: RunShape) -> tuple[dict, dict]:
        """(listed, summed) entries of one batch: x [..., width], valid bool [...] (real, routed tokens)."""
        raise NotImplementedError

    def values(self, observed: Mapping[str, Observed]) -> dict[str, Any]:
        """Each module's value once every batch has passed, from every observed module's entries (empty where
        the statistic observed nothing of it); a module it has no value for is left out."""
        raise NotImplementedError



def _magnitude(x: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(flat float32 x [tokens, width], flat valid [tokens], |x| with padding and unrouted tokens 0)."""
    flat = x.astype(jnp.float32).reshape(-1, x.shape[-1])
    ok = valid.reshape(-1)
    return flat, ok, jnp.where(ok[:, None], jnp.abs(flat), 0.0)


@dataclasses.dataclass(frozen=True)
class InputAbsMax(Statistic):
    """max|x| per input channel over every calibration token (float32 [in]); not finite: the float model
    overflows, which is refused where it appears, so no step ever sees NaN statistics."""

    key = "absmax"

    def observe(self, name, x, valid, run):
        return {"absmax": jnp.max(_magnitude(x, valid)[2], axis=0)}, {}

    def values(self, observed):
        found = {}
        for name, entries in observed.items():
            if not entries.listed:
                continue
            found[name] = np.max(np.stack([np.asarray(o["absmax"]) for o in entries.listed]), axis=0)
            if not np.isfinite(found[name]).all():
                raise InvalidWeightError(
                    f"calibration: the input of {name} holds NaN or Inf: the float model overflows there, or a "
                    "weight before it is not finite; fix the checkpoint")
        return found



@dataclasses.dataclass(frozen=True)
class KeptRows(Statistic):
    """Up to `sample_rows` input rows per linear (float32 [rows, in]), spread over the batches and positions."""

    sample_rows: int = SAMPLE_ROWS
    key = "rows"

    def observe(self, name, x, valid, run):
        flat, ok, _ = _magnitude(x, valid)
        # A spread subset of the tokens. The first ones alone over-represent position 0, whose activations are
        # often atypically large; so does a stride that divides the window length (every row at position 0),
        # so the step is one more than the even stride and the positions vary.
        per_batch = max(1, -(-self.sample_rows // max(1, run.batches)))
        n = flat.shape[0]
        step = n // per_batch + 1 if n > per_batch else 1
        index = (np.arange(min(per_batch, n)) * step) % n
        return {"rows": flat[index], "valid": ok[index]}, {}

    def values(self, observed):
        return {name: np.concatenate([np.asarray(o["rows"])[np.asarray(o["valid"])]
                                      for o in entries.listed])[:self.sample_rows]
                for name, entries in observed.items() if self.asked(name) and entries.listed}



@dataclasses.dataclass(frozen=True)
class InputAbsMean(Statistic):
    """mean |x| per input channel over every calibration token the linear saw (float32 [in]; AWQ's act_mean),
    each batch's sum added in batch order in float64; absent for a module no token reached."""

    key = "abs_mean"

    def observe(self, name, x, valid, run):
        _, ok, magnitude = _magnitude(x, valid)
        return {"abs_sum": jnp.sum(magnitude, axis=0), "tokens": jnp.sum(ok.astype(jnp.int32))}, {}

    def values(self, observed):
        found = {}
        for name, entries in observed.items():
            if not self.asked(name):
                continue
            count = sum(int(o["tokens"]) for o in entries.listed)
            if count:
                total = np.sum(np.stack([np.asarray(o["abs_sum"], np.float64) for o in entries.listed]), axis=0)
                found[name] = (total / count).astype(np.float32)
        return found



@dataclasses.dataclass(frozen=True)
class AttentionAbsMax(Statistic):
    """Per attention block, max|k| and max|v| over every calibration token, keys after RoPE, values as the
    cache stores them: {"keys": float32, "values": float32}, each per tensor (a scalar) or, with
    `per_head`, per KV head [heads]."""

    per_head: bool = False
    site = ATTENTION
    key = "attention_absmax"

    def observe(self, name, kv, valid, run):
        keys, values = kv  # [B, heads, T, head_dim] each
        mask = valid[:, None, :, None]
        axes = (0, 2, 3) if self.per_head else None
        return {"keys": jnp.max(jnp.where(mask, jnp.abs(keys.astype(jnp.float32)), 0.0), axis=axes),
                "values": jnp.max(jnp.where(mask, jnp.abs(values.astype(jnp.float32)), 0.0), axis=axes)}, {}

    def values(self, observed):
        found = {}
        for name, entries in observed.items():
            if not entries.listed:
                continue
            pair = {part: np.max(np.stack([np.asarray(o[part], np.float32) for o in entries.listed]), axis=0)
                    for part in ("keys", "values")}
            if not all(np.isfinite(v).all() for v in pair.values()):
                raise InvalidWeightError(f"calibration: the keys or values of {name} hold NaN or Inf: the float "
                                         "model overflows there; fix the checkpoint")
            found[name] = pair
        return found


class _SharedInputs:
    """Which linears of a traced layer read the very same input (and validity) as an earlier one: they share
    its Hessian, computed once. Filled while tracing, by layer-relative name."""

    def __init__(self):
        self.first: dict[tuple[int, int], tuple[str, Any, Any]] = {}
        self.shares: dict[str, str] = {}  # layer-relative name -> the layer-relative name holding its H

    def owner(self, relative: str, x, valid) -> str:
        key = (id(x), id(valid))
        seen = self.first.get(key)
        if seen is not None and seen[1] is x and seen[2] is valid:  # held, so the ids are not reused
            self.shares[relative] = seen[0]
            return seen[0]
        self.first[key] = (relative, x, valid)
        return relative


@dataclasses.dataclass(frozen=True)
class InputHessian(Statistic):
    """GPTQ's H = 2 X^T X / n per linear (float32 [in, in], left on the device) and n, the tokens it counts
    ("hessian", "tokens"): X the tokens each saw, every window's first left out but for q/k/v (hessian_sum).
    Linears that read the same input (q/k/v, gate/up) hold the same array, summed once."""

    sharing: Any = dataclasses.field(default=None, compare=False)
    key = "hessian"
    held_on_device = True

    def begin(self) -> "InputHessian":
        return dataclasses.replace(self, sharing=_SharedInputs())

    def observe(self, name, x, valid, run):
        relative = layer_relative(name)
        if self.sharing.owner(relative, x, valid) != relative:
            return {}, {}
        total, count = hessian_sum(x, valid, window_start=reads_attention_input(name))
        return {}, {"hessian": total, "count": count}

    def values(self, observed):
        by_relative = {layer_relative(name): name for name in observed}
        sums = {name: entries.summed for name, entries in observed.items() if entries.summed}
        found = {}
        for name in observed:
            owner = by_relative.get(self.sharing.shares.get(layer_relative(name), ""), name)
            if owner in sums:
                tokens = int(sums[owner]["count"])
                held = found.get(owner)
                matrix = held["hessian"] if held else sums[owner]["hessian"] * (2.0 / max(tokens, 1))
                found[name] = {"hessian": matrix, "tokens": tokens}
                found.setdefault(owner, found[name])
        return found



# The linears that compute an attention block's queries, keys and values (fused or not, low-rank or not, in
# the families' spellings): the keys and values every later token attends to come out of them.
ATTENTION_INPUTS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value", "W_pack", "Wqkv", "c_attn",
                    "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "query", "key", "value")


def reads_attention_input(name: str) -> bool:
    """Whether linear `name` computes queries, keys or values from an attention block's input."""
    return name.rsplit(".", 1)[-1] in ATTENTION_INPUTS


def hessian_sum(x: jax.Array, valid: jax.Array, *, window_start: bool = False) -> tuple[jax.Array, jax.Array]:
    """(X^T X float32 [in, in], n) of a linear's input x [..., in] over its valid tokens; GPTQ's Hessian is
    2 X^T X / n. Without `window_start`, the first token of every calibration window is left out.

    A trained LLM's first token is an attention sink: its activations reach thousands in a few channels, so its
    rows can hold most of X^T X (SmolLM2-135M: 79% of layer 28's down_proj input, 98% of layer 11's), and GPTQ,
    minimising the output error those rows dominate, fitted that one token per window while the other tokens'
    error rose to 2.5x round-to-nearest's (docs/ACCURACY.md). The sink's key and value are read by every later
    token, so q/k/v keep it (`window_start`; there its rows hold under 1% of X^T X); its o_proj and MLP
    outputs move only its own residual stream. x [windows, seqlen, in] is a dense linear's input; an expert's
    [tokens, in] input has lost its positions and keeps every valid token.
    """
    flat = x.astype(jnp.float32).reshape(-1, x.shape[-1])
    counted = valid.reshape(-1)
    if x.ndim == 3 and not window_start:
        counted = counted & jnp.broadcast_to(jnp.arange(x.shape[1]) > 0, x.shape[:2]).reshape(-1)
    masked = jnp.where(counted[:, None], flat, 0.0)
    return (jnp.einsum("ti,tj->ij", masked, masked, precision=jax.lax.Precision.HIGHEST),
            jnp.sum(counted.astype(jnp.int32)))


def merge_requests(requests: Sequence[Statistic]) -> tuple[Statistic, ...]:
    """The statistics steps asked for, one per kind (modules unioned), in the order first asked."""
    merged: dict[tuple[type, Any], Statistic] = {}
    for stat in requests:
        kind = (type(stat), tuple((f.name, getattr(stat, f.name)) for f in dataclasses.fields(stat)
                                  if f.name not in ("modules", "sharing")))
        merged[kind] = merged[kind].merged(stat) if kind in merged else stat
    keys = [s.key for s in merged.values()]
    if len(set(keys)) != len(keys):
        raise ValueError(f"two statistics asked for under one key: {sorted(keys)}")
    return tuple(merged.values())


def statistics_asked(keep_inputs=frozenset(), hessians=frozenset(), sample_rows: int = SAMPLE_ROWS,
                     extra: Sequence[Statistic] = ()) -> tuple[Statistic, ...]:
    """Every linear's max|x| (always: it is where a non-finite input is refused), with kept rows and mean |x| of
    `keep_inputs`, Hessians of `hessians`, and `extra`, merged."""
    asked: list[Statistic] = [InputAbsMax()]
    if keep_inputs:
        asked += [KeptRows(frozenset(keep_inputs), sample_rows), InputAbsMean(frozenset(keep_inputs))]
    if hessians:
        asked.append(InputHessian(frozenset(hessians)))
    return merge_requests([*asked, *extra])
