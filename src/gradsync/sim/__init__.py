"""The alpha-beta cost model (cost.py) and what runs it. It serves the run time as well as the
offline tools: algorithm="auto" prices each all-reduce with cost.py on every rank (comm/select.py),
and `gradsync simulate`, `memory` and `figures` run the same model at any scale (sparse.py, memory.py,
figures.py). It imports nothing above it, so the collectives may consult it."""
