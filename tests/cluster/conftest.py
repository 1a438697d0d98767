"""The helpers of the tests of several processes (cluster_helpers) importable by name."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
