"""A run of the `tfdp` command's loop, timed by a hook of its own.

The benchmark rows that measure tfdp train through `training.run`, as the
command does, with every hook a run has (the tutorial's log, the balancing,
the evaluation at the end); `StepStamps`, one more hook, times the steps
after the warm-up.
"""

from __future__ import annotations

import dataclasses
import os
import time

from tfdp.run.loop import Hook
from tfdp.run.observe import CpuAccounting


class CpuSpan:
    """The CPU this process uses from its making to `stop`, and the machine's busy time
    besides it (other processes: on a shared machine, what a row shared the cores with)."""

    def __init__(self):
        self.accounting, self.busy = CpuAccounting(), busy_seconds()

    def stop(self) -> dict:
        cpu = self.accounting.stop()
        busy = busy_seconds()
        if self.busy is not None and busy is not None and "cpu_seconds" in cpu:
            cpu["others_cpu_seconds"] = busy - self.busy - cpu["cpu_seconds"]
        return cpu


class Window:
    """The end of the warm-up's last step and of the last timed step, each stamped once
    that step is done (its loss read), and the CPU this process and the machine used
    between them. No other step is waited for."""

    def __init__(self, warmup: int, iterations: int, middle: bool = False):
        self.first, self.last = warmup - 1, warmup + iterations - 1  # 0-based steps
        # with `middle`, also the end of the first half of the timed steps
        self.middle = warmup + iterations // 2 - 1 if middle and iterations > 1 else None
        self.ends, self.cpu, self.middle_end = [], {}, None

    def step_done(self, step: int, loss) -> None:
        if step == self.middle:
            float(loss)
            self.middle_end = time.perf_counter()
        if step not in (self.first, self.last):
            return
        float(loss)  # the step is done
        self.ends.append(time.perf_counter())
        if step == self.first:
            self.span = CpuSpan()
        else:
            self.cpu = self.span.stop()

    @property
    def seconds(self) -> float:
        if len(self.ends) != 2:
            raise RuntimeError(f"the run ended before step {self.last + 1} of the timed window")
        return self.ends[1] - self.ends[0]


class StepStamps(Hook):
    """`Window` as a hook of tfdp's loop, and the loop's start (set-up is before it)."""

    def __init__(self, window: Window):
        self.window = window
        self.begin = None

    def on_train_begin(self, run):
        self.begin = time.perf_counter()

    def on_step_end(self, run, step):
        self.window.step_done(step, run.outputs["logs"]["loss"])


def keras_window(warmup: int, iterations: int):
    """`Window` as a Keras callback (a Keras `fit` row's clock): `.window`."""
    import keras

    class WindowCallback(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.window = Window(warmup, iterations)

        def on_train_batch_end(self, batch, logs=None):
            self.window.step_done(batch, logs["loss"])

    return WindowCallback()


def cpu_of(result: dict) -> dict:
    """The CPU fields of `run`'s result (`CpuSpan`'s over the timed steps)."""
    return {k: v for k, v in result.items() if k.endswith("cpu_seconds") or k.startswith("steal")}


def busy_seconds() -> float | None:
    """The machine's busy CPU seconds so far, all cores and processes together (Linux
    /proc/stat: user, nice, system, irq, softirq); None where /proc is not there."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return None
    return sum(ticks[i] for i in (0, 1, 2, 5, 6)) / os.sysconf("SC_CLK_TCK")


def run(config, warmup: int, iterations: int, halves_asked: bool = False) -> dict:
    """Trains `warmup + iterations` steps as the `tfdp` command trains them (its output
    left out), and times the last `iterations`.

    Returns the run's result (result.json's fields) with this timing: `seconds` of the
    timed steps, `set_up_seconds` from the start to the first step (the trainer, a
    simulated slowdown's calibration, auto powers' probes), `warmup_seconds` from the
    start to the end of the warm-up, and the CPU used over the timed steps; with
    `halves_asked`, also `images_per_second_second_half`, of the last half of the timed
    steps (a rebalanced row's, once it has settled)."""
    from tfdp.run import training
    from tfdp.run.plan import prepare

    if warmup < 1 or iterations < 1:
        raise ValueError(f"warmup={warmup}, iterations={iterations}: both must be at least 1")
    config = dataclasses.replace(config, iterations=warmup + iterations)
    plan = prepare(config)
    stamps = StepStamps(Window(warmup, iterations, middle=halves_asked))
    start = time.perf_counter()
    result = training.run(plan, log=lambda line: None, hooks=[stamps])
    window = stamps.window
    seconds = window.seconds
    batch = plan.config.batch_size
    halves = {}
    if halves_asked:  # one timed step has no halves: the second is the whole
        start_half = window.middle_end or window.ends[0]
        second_half = iterations - iterations // 2 if window.middle_end else iterations
        halves["images_per_second_second_half"] = second_half * batch / (window.ends[1] - start_half)
    return {
        **result,
        "run_seconds": result["seconds"],  # the run's own clock: all its steps, the first's too
        "seconds": seconds,
        "images_per_second": iterations * batch / seconds,
        "set_up_seconds": stamps.begin - start,
        "warmup_seconds": window.ends[0] - start,
        **window.cpu,
        **halves,
    }


SYNTHETIC = "tfdp.bench.timed:synthetic_mnist"  # --synthetic: the rows' dataset


def synthetic_mnist():
    """`--synthetic`'s training data for the `tfdp` command's rows (`--dataset`): random
    images of MNIST's shape, no validation."""
    from tfdp.data import mnist

    arrays = mnist.synthetic_mnist()
    return (arrays.images.astype("float32") / 255.0, arrays.labels), None
