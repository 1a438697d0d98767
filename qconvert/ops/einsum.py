"""einsum on jax.Arrays and QArrays, mirroring jax.numpy.einsum, as pairwise dot_generals.

Operands are contracted left to right. A label shared by the pair and needed
later (by the output or a later operand) is a batch dim; shared and not needed
is contracted; a label only one operand has and nobody needs is summed out of
that operand first (which dequantizes a QArray, since a sum over a quantized
axis does not stay quantized). Each pair goes through qconvert.ops.dot_general,
so the integer fast path applies per pair.
"""

from __future__ import annotations

import string

import jax
import jax.numpy as jnp

from qconvert.ops.dispatch import choose_path, operand_shape
from qconvert.ops.dot import dot_general
from qconvert.ops.scales import as_float, float_aval


def _parse(subscripts: str, ndims: list[int]) -> tuple[list[str], str]:
    """Input label strings (ellipses expanded to fresh labels) and the output labels."""
    spec = subscripts.replace(" ", "")
    inputs_part, arrow, output_part = spec.partition("->")
    inputs = inputs_part.split(",")
    if len(inputs) != len(ndims):
        raise ValueError(f"einsum subscripts name {len(inputs)} operands but {len(ndims)} were given")
    used = set(spec) - {".", ",", "-", ">"}
    fresh = [c for c in string.ascii_letters if c not in used]
    longest_ellipsis = max((n - len(s.replace("...", "")) for s, n in zip(inputs, ndims) if "..." in s), default=0)
    ellipsis_labels = "".join(fresh[:longest_ellipsis])
    expanded = []
    for labels, ndim in zip(inputs, ndims):
        if "..." in labels:
            width = ndim - len(labels.replace("...", ""))
            labels = labels.replace("...", ellipsis_labels[longest_ellipsis - width:])
        if len(labels) != ndim:
            raise ValueError(f"einsum subscript {labels!r} does not match an operand of rank {ndim}")
        expanded.append(labels)
    if arrow:
        output = output_part.replace("...", ellipsis_labels)
    else:
        counts = {c: "".join(expanded).count(c) for c in set("".join(expanded))}
        output = ellipsis_labels + "".join(sorted(c for c, k in counts.items() if k == 1 and c not in ellipsis_labels))
    return expanded, output


def _sum_unneeded(x, labels: str, needed: set[str]):
    """Sum out axes no one else needs; a QArray is dequantized to do so."""
    drop = [i for i, c in enumerate(labels) if c not in needed]
    if not drop:
        return x, labels
    return jnp.sum(as_float(x), axis=tuple(drop)), "".join(c for c in labels if c in needed)


def _contract_pair(a, a_labels, b, b_labels, needed_after, precision, preferred_element_type):
    a, a_labels = _sum_unneeded(a, a_labels, set(b_labels) | needed_after)
    b, b_labels = _sum_unneeded(b, b_labels, set(a_labels) | needed_after)
    shared = [c for c in a_labels if c in b_labels]
    batch = [c for c in shared if c in needed_after]
    contract = [c for c in shared if c not in needed_after]
    dn = (
        (tuple(a_labels.index(c) for c in contract), tuple(b_labels.index(c) for c in contract)),
        (tuple(a_labels.index(c) for c in batch), tuple(b_labels.index(c) for c in batch)),
    )
    out = dot_general(a, b, dn, precision=precision, preferred_element_type=preferred_element_type, _op="einsum")
    out_labels = "".join(batch) + "".join(c for c in a_labels if c not in shared) + "".join(
        c for c in b_labels if c not in shared
    )
    return out, out_labels


def einsum(subscripts: str, *operands, precision=None, preferred_element_type=None) -> jax.Array:
    """jax.numpy.einsum where any operand may be a QArray.

    Explicit ('ij,jk->ik') and implicit ('ij,jk') forms and ellipses are
    accepted. The result equals jnp.einsum on the dequantized operands in shape
    and dtype (operands are promoted to their common dtype, as jnp does).
    """
    expanded, output = _parse(subscripts, [len(operand_shape(x)) for x in operands])
    promoted = jnp.result_type(*[float_aval(x).dtype for x in operands])
    out_type = preferred_element_type if preferred_element_type is not None else promoted
    if len(operands) == 1 or any(len(set(labels)) != len(labels) for labels in expanded):
        # A single operand or a repeated label (a diagonal) has no pairwise dot to run.
        for x in operands:
            choose_path("einsum", x, x, lhs_contracting=(), rhs_contracting=(), out_dtype=out_type,
                        int8_blocker="a single operand or a repeated label has no pairwise dot")
        return jnp.einsum(subscripts, *[as_float(x) for x in operands], precision=precision,
                          preferred_element_type=preferred_element_type)
    result, labels = operands[0], expanded[0]
    for i in range(1, len(operands)):
        needed_after = set(output).union(*expanded[i + 1:])
        result, labels = _contract_pair(result, labels, operands[i], expanded[i], needed_after, precision, out_type)
    result, labels = _sum_unneeded(result, labels, set(output))
    result = jnp.transpose(as_float(result), tuple(labels.index(c) for c in output))
    return result.astype(out_type)

