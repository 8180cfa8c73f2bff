"""The states an expert tensor can be in, named once for the runtime, the planner and the reports.

A chosen expert tensor is in one of the four cache pools, or in none (a miss):

* ``full``: the bf16 tensor (or the compute dtype's), ready to compute with;
* ``compressed``: its stored E chunks and SM bytes (decompress E, merge, compute);
* ``sm_only``: its SM bytes only (read E, decompress, merge);
* ``e_only``: its stored E chunks only (read SM, decompress, merge);
* ``none``: nothing cached (read both, decompress, merge).

``POOLS`` are the cache's pools, ``STATES`` those plus ``none``, both hottest first (the order
the planner gives slots to experts by popularity rank, and the order reports print them in).
"""

POOLS = ("full", "compressed", "sm_only", "e_only")
STATES = POOLS + ("none",)
