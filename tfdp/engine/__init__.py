"""One step for every mode: the model's own step under the mode's strategy.

modes.py      each mode a strategy: `build_trainer` for the run's mode and devices
trainer.py    the one Trainer: drives the model's step, its evaluation, the probes
multiworker.py  the Trainer of one worker of a cluster
strategy.py   tfdp.MirroredStrategy: uneven pieces of each global batch, exact
cluster_strategy.py  tfdp.MultiWorkerMirroredStrategy, and joining the cluster
pieces.py     the cut: one rule for every door, the pieces' rows
books.py      the strategy's shares and the timing of its steps (StepClock, auto powers)
replica.py    what a weighed replica step carries while it is traced
shards.py     the exact weighting of uneven shards; whole_batch.py the whole batch's logs
              and BatchNormalization statistics
patches.py    every replacement of Keras' and TensorFlow's functions, installed once
placement.py  the model's variables placed for a strategy
split.py      the split: shares, sizes, measurement, what a checkpoint saves
steps.py      a device's work on its shard (chains, probes); clock.py the host clock's ops
"""
