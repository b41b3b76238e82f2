"""What the training loop asks of a trainer, and what the trainers share.

A trainer is one mode: it places the model's variables for its devices
(`replicas.Placement`), splits each global batch over them, runs the model's own
`train_step` on every shard (`steps.DeviceWork`) and reduces the gradients the
shards hand over into one update. The loop (`training.run`) calls only what this
class declares; it never asks which mode it runs, so adding a mode means adding
a trainer.
"""

from __future__ import annotations

import tensorflow as tf

from tfdp.exchange import LOCAL
from tfdp.replicas import kept
from tfdp.split import DeviceSplit


class Trainer:
    """The interface of every mode, with the defaults of a single process.

    Attributes a trainer sets:
      devices: what the batch is split over (device names, or worker names).
      shards: examples of a full global batch on each, in order.
      global_batch_size: examples per step over all of them.
      model: the model being trained (the user's own object, its variables placed
        for the mode while the trainer is open); optimizer: its optimizer.
      chains: side-by-side pieces each device cuts its shard into.
      exchange: what the processes of the run tell each other (`exchange.Local`,
        or `exchange.Cluster` in a cluster).
      balanced: the split is the run's own (mode weighted): it may be measured,
        rebalanced, and saved with a checkpoint.
      timed: each step reads every device's seconds from the host clock; only
        when something reads them (auto powers, rebalancing, the simulated
        slowdown), since on a GPU the clock syncs the device with the host.
    """

    unit = "device(s)"  # what `devices` are, for the banner
    is_chief = True  # this process writes the run's files
    chains = 1
    balanced = False
    timed = True  # each step reads each device's seconds (`device_seconds`)
    Split = DeviceSplit  # what splits the batch before training (split.py)
    exchange = LOCAL  # what this process tells the others of its run (exchange.py)
    placement = None  # the model's variables placed for the mode (`replicas.Placement`)
    jit_compile = False  # each device's forward and backward pass is an XLA program

    # --- the step (each trainer implements `_step` and `_test`)

    host_iterator = True  # `distribute` gives a tf.data iterator (its position can be saved)

    def distribute(self, dataset):
        """The iterator `train_step` reads, from a dataset of global batches."""
        return iter(dataset)

    def distribute_indices(self, indices, gather):
        """The iterator `train_step` reads, from a dataset of global batches of example
        indices into arrays, and `gather` (indices -> their batch). Trainers that read a
        whole global batch gather it here; multiworker gathers only its worker's slice."""
        from tfdp.data import prefetched

        return self.distribute(prefetched(indices.map(gather)))

    def compile(self) -> None:
        """Makes the compiled step functions, as the model asks: eager with `run_eagerly`,
        else one tf.function per kind of call (autograph off, as Keras traces a step)."""
        if self.model.run_eagerly:
            wrap = _eager
        else:
            wrap = lambda f: tf.function(f, autograph=False, reduce_retracing=True)  # noqa: E731
        self._train_step = wrap(self._one_step)
        self._train_steps = wrap(self._steps)
        self._test_step = wrap(self._test)

    def train_step(self, iterator, steps: int = 1) -> dict | None:
        """Up to `steps` updates on the next global batches, in one compiled call (Keras'
        `steps_per_execution`), fewer where the data ends. Returns tensors: `logs`, what
        the model's train_step returned for the last of them (its metrics over the whole
        batch, running since `model.reset_metrics()`), `device_seconds` of that step
        (zeros where devices are not timed), and `steps`, how many ran; None when the
        data had ended before the first."""
        try:
            if steps == 1:
                return self._train_step(iterator)
            return self._train_steps(iterator, tf.constant(steps))
        except (tf.errors.OutOfRangeError, StopIteration):  # (StopIteration: run eagerly)
            return None

    marked = False  # each element is (batch, whether its pass has ended) (`Stream.marked`)

    def _one_step(self, iterator):
        return self._step_on(next(iterator))

    def _step_on(self, element):
        """One step on an element of the stream: its outputs, with `steps` 1, or 0 for a
        marker of a pass's end, which is not trained on."""
        if not self.marked:
            return {**self._step(element), "steps": tf.constant(1)}
        batch, ended = element
        if tf.executing_eagerly():  # run_eagerly: the marker read, nothing to train
            if bool(ended):
                return {"steps": tf.constant(0)}
            return {**self._step(batch), "steps": tf.constant(1)}
        traced = {}

        def train():
            traced.update(self._step(batch))
            return {**traced, "steps": tf.constant(1)}

        def skip():  # traced after `train` (tf.cond traces its true branch first)
            return {**tf.nest.map_structure(tf.zeros_like, traced), "steps": tf.constant(0)}

        return tf.cond(tf.logical_not(ended), train, skip)

    def _steps(self, iterator, steps):
        """Up to `steps` steps, as Keras runs `steps_per_execution`: each next batch read
        only while another step is due, and none read past the data's end (or its pass's
        end, in a marked stream)."""
        outputs = self._step_on(next(iterator))
        if self.model.run_eagerly:
            done = int(outputs["steps"])
            while done and done < int(steps):
                upcoming = iterator.get_next_as_optional()
                if not upcoming.has_value():
                    break
                more = self._step_on(upcoming.get_value())
                if not int(more["steps"]):
                    break
                outputs, done = more, done + 1
            return {**outputs, "steps": tf.constant(done)}

        def more(done, ended, outputs, upcoming):
            return tf.logical_and(
                tf.logical_and(done < steps, tf.logical_not(ended)), upcoming.has_value()
            )

        def read_on(done, ended, upcoming):
            """The next element, read only if another step is due."""
            return tf.cond(
                tf.logical_and(done < steps, tf.logical_not(ended)),
                iterator.get_next_as_optional,
                lambda: upcoming,
            )

        def step(done, ended, outputs, upcoming):
            new = self._step_on(upcoming.get_value())
            ran = new.pop("steps")
            outputs = tf.nest.map_structure(  # a marker leaves the last step's outputs
                lambda a, b: tf.where(ran > 0, a, b), new, outputs
            )
            done, ended = done + ran, tf.equal(ran, 0)
            return done, ended, outputs, read_on(done, ended, upcoming)

        first = dict(outputs)
        done = first.pop("steps")
        ended = tf.equal(done, 0)
        nothing = tf.experimental.Optional.empty(iterator.element_spec)
        start = (done, ended, first, read_on(done, ended, nothing))
        done, _, outputs, _ = tf.while_loop(more, step, start)
        return {**outputs, "steps": done}

    def test_step(self, batch) -> dict:
        """The model's test_step on an evaluation batch, split over the devices as a
        training batch is: its logs, the metrics over every batch since
        `model.reset_metrics()`."""
        return self._test_step(batch)

    def notes(self) -> list[str]:
        """How the model's own train_step is run, where not as Keras runs it (once traced)."""
        work = getattr(self, "work", None)
        return list(work.notes) if work is not None else []

    def get_weights(self) -> list:
        return self.model.get_weights()

    def set_weights(self, weights) -> None:
        self.model.set_weights(weights)

    def close(self) -> None:
        """The model's variables back as the model had them, with the trained values."""
        if self.placement is not None:
            self.placement.exit()
            self.placement = None

    # --- the split

    def set_shards(self, shards) -> None:
        """Splits the following batches as `shards` (same global batch)."""
        if sum(shards) != self.global_batch_size or len(shards) != len(self.devices):
            raise ValueError(f"shards {shards} do not split {self.global_batch_size} examples")
        self.shards = list(shards)
        self.shard_sizes.assign(shards)

    def set_delays(self, delays) -> None:
        """Simulated slowdown: seconds of sleep per example, per device."""
        self.delays.assign(delays)

    def seconds_alone(self, batch, index: int) -> float:
        """Device `index`'s seconds for its forward and backward pass on `batch`, the others
        idle, without an update (the model's state as it was before)."""
        with self.untouched():
            return float(self._seconds_alone(batch, index))

    def seconds_together(self, batch):
        """Each device's seconds for forward and backward on its shard of the global
        batch, all devices at once as in a step, without an update."""
        with self.untouched():
            return self._seconds_together(batch).numpy()

    def untouched(self):
        """Inside: what a probe step changes besides the weights (metrics, batch-norm
        statistics, random seeds) is put back afterwards."""
        model = self.model
        return kept([*model.non_trainable_variables, *model.metrics_variables])

    def describe(self) -> str:
        """What the banner adds about this mode's reduction."""
        return ""

    # --- files and the cluster

    def checkpointer(self, config):
        """What saves and restores this trainer in `config.model_dir`."""
        from tfdp.checkpoints import Checkpointer

        return Checkpointer(config, self)

    def result_info(self) -> dict:
        """This trainer's own entries in the result."""
        return {"chains": self.chains, "jit_compile": self.jit_compile}


def _eager(function):
    return function
