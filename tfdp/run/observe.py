"""What a person watching a run sees: a live progress line, TensorBoard summaries,
and where the machine's time went (CPU seconds, time stolen by the hypervisor)."""

from __future__ import annotations

import os
import sys
import time


def format_duration(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}"


class Progress:
    """One line, rewritten in place: step, loss and metrics, images/s, ETA.

    Reading a step's metrics waits for the device, so the line is refreshed at
    most every `interval` seconds, not at every step. `clock` (seconds, any
    origin) is injectable so that a test can drive the rates exactly.
    """

    def __init__(
        self,
        total_steps,
        batch_size,
        first_step=0,
        stream=None,
        interval=0.5,
        clock=time.perf_counter,
    ):
        self.total_steps = total_steps
        self.batch_size = batch_size
        self.stream = stream or sys.stderr
        self.interval = interval
        self.clock = clock
        self.start_step = first_step
        self.start_time = clock()
        self.last_shown = None  # the first update is always shown
        self.width = 0

    def update(self, step, metrics, force=False):
        """`step` steps are done; `metrics` are the last step's loss and metrics (numbers or
        tensors), or a function of no arguments that reads them (called only when shown)."""
        now = self.clock()
        shown_lately = self.last_shown is not None and now - self.last_shown < self.interval
        if not force and shown_lately:
            return
        self.last_shown = now
        done = step - self.start_step
        elapsed = now - self.start_time
        rate = done / elapsed if done and elapsed > 0 else 0.0  # no time yet: no rate
        known = self.total_steps is not None  # a stream of unknown length: no end in sight
        eta = (self.total_steps - step) / rate if rate and known else 0.0
        values = metrics() if callable(metrics) else metrics
        names = sorted(values, key=lambda name: name != "loss")  # the loss first
        shown = " | ".join(f"{name} {float(values[name]):.4f}" for name in names)
        line = (
            f"step {step}/{self.total_steps if known else '?'} | {shown} | "
            f"{rate * self.batch_size:.0f} images/s"
            + (f" | ETA {format_duration(eta)}" if known else "")
        )
        self.width = max(self.width, len(line))
        self.stream.write("\r" + line.ljust(self.width))
        self.stream.flush()

    def clear(self):
        """Blanks the line so that a log line can be printed in its place."""
        if self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()

    def close(self):
        if self.width:
            self.stream.write("\n")
            self.stream.flush()
            self.width = 0


class Summaries:
    """TensorBoard scalars under DIR/train and DIR/eval."""

    def __init__(self, model_dir):
        import tensorflow as tf

        self.tf = tf
        self.train = tf.summary.create_file_writer(os.path.join(model_dir, "train"))
        self.eval = tf.summary.create_file_writer(os.path.join(model_dir, "eval"))

    def write_train(self, step, scalars):
        with self.train.as_default(step=step):
            for name, value in scalars.items():
                self.tf.summary.scalar(name, value)

    def write_eval(self, step, scalars):
        with self.eval.as_default(step=step):
            for name, value in scalars.items():
                self.tf.summary.scalar(name, value)

    def close(self):
        self.train.flush()
        self.eval.flush()


class CpuAccounting:
    """This process's CPU seconds and the machine's stolen time over an interval.

    Stolen time is what the hypervisor gave to other guests while this machine
    wanted to run (Linux /proc/stat); it explains a slow measurement that
    the code does not. Empty where /proc is not there.
    """

    def __init__(self):
        self.start = self._read()

    @staticmethod
    def _read():
        try:
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
        except OSError:
            return None
        times = os.times()
        return fields, times.user + times.system

    def stop(self) -> dict:
        end = self._read()
        if self.start is None or end is None:
            return {}
        (before, cpu_before), (after, cpu_after) = self.start, end
        ticks = [b - a for a, b in zip(before, after)]
        tick = os.sysconf("SC_CLK_TCK")
        steal = ticks[7] if len(ticks) > 7 else 0
        return {
            "cpu_seconds": cpu_after - cpu_before,
            "steal_seconds": steal / tick,
            "steal_fraction": steal / max(sum(ticks[:8]), 1),
        }
