"""Group metadata for the grouped (MoE) matmuls: which row tile of which group each grid step visits."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def make_group_metadata(*, group_sizes: jax.Array, m: int, tm: int, start_group, num_nonzero_groups: int,
                        visit_empty_groups: bool):
    """Map grid steps to (group, row tile) pairs for groups [start_group, start_group + num_nonzero_groups).

    Rows are sorted by group: group g owns rows [group_offsets[g], group_offsets[g+1]).
    A row tile that straddles a group boundary is visited once per group it holds
    (the kernels mask the rows of other groups). Empty groups are skipped, or
    visited once (visit_empty_groups, needed where an empty group's output must
    still be zeroed, as in transposed_grouped_matmul).

    Returns ((group_offsets [G+1], group_ids [tiles_m + G], m_tile_ids [tiles_m + G]), num_tiles):
    step i < num_tiles works on group group_ids[i], row tile m_tile_ids[i]; the
    steps past num_tiles repeat the last real step (so they fetch nothing new).
    """
    sizes = jnp.asarray(group_sizes, jnp.int32)
    num_groups = sizes.shape[0]
    tiles_m = -(-m // tm)
    ends = jnp.cumsum(sizes)
    group_offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])
    starts = group_offsets[:-1]
    first_tile = starts // tm
    tiles = (ends + tm - 1) // tm - first_tile
    tiles = jnp.where(sizes == 0, 1 if visit_empty_groups else 0, tiles)
    group = jnp.arange(num_groups)
    start_group = jnp.asarray(start_group, jnp.int32).reshape(())
    active = (group >= start_group) & (group < start_group + num_nonzero_groups)
    tiles = jnp.where(active, tiles, 0)
    num_tiles = jnp.sum(tiles)

    steps = tiles_m + num_groups
    tiles_before = jnp.cumsum(tiles)
    step = jnp.minimum(jnp.arange(steps), jnp.maximum(num_tiles - 1, 0))
    group_ids = jnp.minimum(jnp.searchsorted(tiles_before, step, side="right"), num_groups - 1).astype(jnp.int32)
    within = step - (tiles_before - tiles)[group_ids]
    # An empty group at the very end starts at row m: clamp to a real tile (its rows mask to nothing).
    m_tile_ids = jnp.minimum(first_tile[group_ids] + within, tiles_m - 1).astype(jnp.int32)
    return (group_offsets, group_ids, m_tile_ids), num_tiles.astype(jnp.int32)
