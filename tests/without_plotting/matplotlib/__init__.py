"""What the processes the tests start find for `import matplotlib`: nothing (conftest.py)."""

raise ModuleNotFoundError(
    "matplotlib is hidden from this test process (tests/conftest.py)", name="matplotlib"
)
