"""`python -m tfdp.bench`: the same as `tfdp-bench` (its worker processes start this way)."""

from tfdp.bench.table import run

run()
