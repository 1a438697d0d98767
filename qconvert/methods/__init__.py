"""Per-layer steps on complete statistics: the loop that runs them (loop.py) and one file per method."""
