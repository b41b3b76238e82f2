"""Which steps make each epoch: Keras fit's rule, over the passes of the data.

Keras' fit (its `EpochIterator`) cuts training into epochs by three numbers: the
batches of one pass over the data (N: known, infinite, or unknown until a pass
ends), `steps_per_epoch` (S) and the model's `steps_per_execution` (k):
- an epoch is S steps, or one pass when S is not given;
- an epoch never runs past the end of a pass: it ends there, early, and the next
  epoch starts a new pass (S = 7 over passes of 5 batches: epochs of 5);
- an epoch runs in calls of k steps (the last of a pass may have fewer left), and
  its batch hooks see batches 0, k, 2k, ..., each call's last as its first + k - 1.
tfdp follows the same rule, and `--iterations` (tfdp's own) stops a run after that
many steps wherever it is. The steps run so far are the input position: passes
follow one another in the data's stream, so step s always reads the same batch.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass
class Cursor:
    """Where a run is in its epochs and in its data.

    Attributes:
      epoch: the epoch being run (or the next one, between epochs).
      step: steps run so far (the input position in the data's stream).
      batch: the epoch's next batch index, as Keras' batch hooks count it.
      seen: the current pass's steps as Keras counts them (k for every call).
      batches: batches of a pass: known, math.inf, or None until a pass ends.
      pass_over: the current pass has ended; the next epoch starts a new one.
      passes: passes over the data ended so far.
    """

    epoch: int
    step: int = 0
    batch: int = 0
    seen: int = 0
    batches: float | None = None
    pass_over: bool = False
    passes: int = 0

    def state(self) -> dict:
        """What a checkpoint keeps of it (numbers; an infinite pass as -1)."""
        fields = dataclasses.asdict(self)
        if fields["batches"] == math.inf:
            fields["batches"] = -1
        return fields

    @classmethod
    def from_state(cls, state: dict) -> Cursor:
        fields = dict(state)
        if fields.get("batches") == -1:
            fields["batches"] = math.inf
        return cls(**fields)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The epochs of a run, by Keras' rule.

    Attributes:
      batches: batches of one pass over the data (math.inf: an endless stream; None:
        unknown until a pass ends).
      steps_per_epoch: Keras' `steps_per_epoch` (None: an epoch is a pass).
      per_execution: steps per compiled call (the model's `steps_per_execution`).
      initial_epoch: the number of the first epoch.
      final_epoch: the number of the epoch after the last (Keras' `epochs`); None:
        as many as `max_steps` takes.
      max_steps: stop after this many steps (tfdp's `iterations`); None: at the end
        of `final_epoch - 1`.
    """

    batches: float | None
    steps_per_epoch: int | None
    per_execution: int = 1
    initial_epoch: int = 0
    final_epoch: int | None = None
    max_steps: int | None = None

    def start(self) -> Cursor:
        return Cursor(self.initial_epoch, batches=self.batches)

    def running(self, cursor: Cursor) -> bool:
        """Whether the run has an epoch (or a step of one) left."""
        if self.max_steps is not None and cursor.step >= self.max_steps:
            return False
        return self.final_epoch is None or cursor.epoch < self.final_epoch

    def calls(self, cursor: Cursor):
        """The calls left in the cursor's epoch, as (batch index, steps asked), in turn:
        the caller runs each and reports it with `ran` before taking the next."""
        length = self.steps_per_epoch or self.batches or math.inf
        k = self.per_execution
        while cursor.batch < length and not cursor.pass_over:
            count = k
            if self.batches is not None and self.batches != math.inf:
                count = min(k, int(self.batches) - cursor.seen)  # what the pass has left
            if self.max_steps is not None:
                count = min(count, self.max_steps - cursor.step)
            if count <= 0:
                break
            yield cursor.batch, count

    def ran(self, cursor: Cursor, asked: int, ran: int) -> None:
        """A call asked for `asked` steps and ran `ran` (fewer: the pass ended)."""
        if ran < asked and cursor.batches is None:
            cursor.batches = cursor.seen + ran  # learned as the first pass ends
        over = ran < asked  # where the passes' length is not known, reading finds the end
        cursor.step += ran
        cursor.seen += asked
        cursor.batch += asked
        if self.batches is not None and cursor.seen >= self.batches:
            over = True
        if over and not cursor.pass_over:
            cursor.pass_over = True
            cursor.passes += 1

    def end_epoch(self, cursor: Cursor) -> None:
        """The next epoch: a new pass if this one ended (or if an epoch is a pass)."""
        cursor.epoch += 1
        cursor.batch = 0
        if cursor.pass_over or self.steps_per_epoch is None:
            cursor.seen = 0
            cursor.pass_over = False

    def total_steps(self) -> int | None:
        """The run's steps, where they follow from the numbers (None: they depend on
        where unknown passes end, or the run has no end but its data's)."""
        if self.final_epoch is None:
            return self.max_steps
        if self.batches is None or (self.batches == math.inf and not self.steps_per_epoch):
            return self.max_steps
        cursor = self.start()
        while self.running(cursor):
            for _, count in self.calls(cursor):
                self.ran(cursor, count, count)
            self.end_epoch(cursor)
        return cursor.step

    def at(self, step: int) -> Cursor:
        """The cursor after `step` steps from the start, for passes of known length (a
        checkpoint saved before the cursor was kept)."""
        cursor = self.start()
        while cursor.step < step and self.running(cursor):
            for _, count in self.calls(cursor):
                self.ran(cursor, count, count)
                if cursor.step >= step:
                    break
            if cursor.step >= step and not self.ends_epoch(cursor):
                return cursor
            self.end_epoch(cursor)
        return cursor

    def at_epoch(self, epoch: int) -> Cursor:
        """The cursor at the first batch of `epoch`: after the steps of the epochs before
        it, where passes have a known length; else only the epoch's number."""
        cursor = self.start()
        if self.batches is None:
            cursor.epoch = epoch
            return cursor
        while cursor.epoch < epoch:
            for _, count in self.calls(cursor):
                self.ran(cursor, count, count)
            self.end_epoch(cursor)
        return cursor

    def ends_epoch(self, cursor: Cursor) -> bool:
        """Whether the cursor stands at its epoch's end (its last call has run): the pass
        ended, or the epoch's steps are done."""
        length = self.steps_per_epoch or self.batches or math.inf
        return cursor.pass_over or cursor.batch >= length
