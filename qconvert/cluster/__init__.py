"""One conversion over several processes: joining them (qconvert's own join, then jax.distributed), agreeing on
the run's settings and outcome, and sharing what one process computed with the others.

One process (the usual run) never touches any of it: `active()` is False and every helper here is a no-op or
the identity.
"""

from qconvert.cluster.joining import start
from qconvert.cluster.runtime import (Launch, active, is_leader, leave, note_failure, process_count, process_index,
                                      settle)
from qconvert.cluster.share import agree_settings, agree_source

__all__ = ["Launch", "agree_settings", "agree_source", "active", "is_leader", "leave", "note_failure", "process_count",
           "process_index", "settle", "start"]
