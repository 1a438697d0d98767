"""CheckpointParams: a lazy, read-only Mapping from tensor name to array over a safetensors checkpoint."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from qconvert.formats.safetensors_io import SafetensorsCheckpoint


class CheckpointParams(Mapping):
    """A read-only Mapping view of a checkpoint: each tensor is read from its shard when asked for."""

    def __init__(self, checkpoint: SafetensorsCheckpoint):
        self.checkpoint = checkpoint

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.checkpoint:
            raise KeyError(name)
        return self.checkpoint.get(name)

    def __contains__(self, name: object) -> bool:
        # Mapping's default would read the whole tensor just to answer `in`.
        return name in self.checkpoint

    def __iter__(self) -> Iterator[str]:
        return iter(self.checkpoint.tensor_names)

    def __len__(self) -> int:
        return len(self.checkpoint)
