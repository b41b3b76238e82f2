"""Benchmarks: commands that print figures (a table and JSON lines), never tests.

    tfdp-bench                    table.py: the tutorial's timing table against Keras fit
    tfdp-bench --suite=mixed      mixed.py: splits over unequal devices
    tfdp-bench --suite=gpu        gpu.py: single GPU, all GPUs, GPU+CPU, each beside Keras fit
                                  (logical CPUs stand in where there is no GPU)
    tfdp-bench --suite=cluster    cluster.py: 2 workers, one slowed: even split vs rebalanced
    tfdp-bench --suite=switches   table.py: the step with --jit_compile and each --precision
    tfdp-bench --suite=streaming  streaming.py: a small ResNet on TFRecord files through tf.data,
                                  beside Keras fit and MirroredStrategy, and against in memory
    python -m tfdp.bench.memory   memory.py: peak memory of a stream against the data's size
    python -m tfdp.bench.steps    steps.py: variants of one training step, timed and profiled
    flops.py                      LeNet's FLOPs per image, as the table counts them
    records.py                    random image datasets written as TFRecord files

They drive tfdp through its library (Config, build_trainer, the data
pipeline), as a user's script would.
"""
