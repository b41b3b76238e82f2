"""Benchmarks: commands that print figures (a table and JSON lines), never tests.

    tfdp-bench                    table.py: the tutorial's timing table against Keras fit
    tfdp-bench --suite=mixed      mixed.py: splits over unequal devices
    python -m tfdp.bench.steps    steps.py: variants of one training step, timed and profiled
    flops.py                      LeNet's FLOPs per image, as the table counts them

They drive tfdp through its library (Config, build_trainer, the data
pipeline), as a user's script would.
"""
