"""What the processes the tests start find for `import IPython`: nothing (conftest.py)."""

raise ModuleNotFoundError(
    "IPython is hidden from this test process (tests/conftest.py)", name="IPython"
)
