"""`python -m tfdp`: the same as the `tfdp` command."""

from tfdp.cli import run

run()
