"""Where a run continues from: its checkpoint, its split, its data's position.

`restore` reads the latest good checkpoint; `position` puts the run's epochs and its
data where that checkpoint left them (`epochs.Cursor`, saved with every checkpoint
since it was kept; before that, worked out from the step for data of known length).
"""

from __future__ import annotations

import json
import os

from tfdp.config import AUTO, Config
from tfdp.data import bad_data, streams
from tfdp.data.epochs import Cursor
from tfdp.errors import ConfigError
from tfdp.run.hooks.membership import after_a_change
from tfdp.run.hooks.report import learning_rate, schedule_of
from tfdp.run.plan import Plan


def position(plan: Plan, checkpointer, start_step: int) -> Cursor:
    """Where the run stands after `start_step` steps: as saved with the checkpoint, or
    worked out from the step by the run's schedule. A checkpoint keeps the cursor under
    "cursor" in its run state (`keep_position`)."""
    saved = checkpointer.state.restored.get("cursor") if checkpointer else None
    if saved is not None and start_step:
        cursor = Cursor.from_state(saved)
        if cursor.step == start_step:
            if plan.schedule.ends_epoch(cursor):  # saved after its epoch's end: the next
                plan.schedule.end_epoch(cursor)
            return cursor
    return plan.schedule.at(start_step)


def keep_position(checkpointer, run) -> None:
    """Every checkpoint from now on keeps the run's cursor."""
    if checkpointer is not None:
        checkpointer.state.providers["cursor"] = lambda: run.cursor.state()


def resumed_shares(config: Config, trainer, checkpointer) -> dict | None:
    """The split a resumed run continues with: the one saved with its checkpoint, when
    the split was measured (auto powers or rebalancing) and the devices are the same.

    Any split makes the same update; this only spares the run measuring again. After a
    change of the cluster's members (tfdp-launch), the shares are measured again.
    """
    if after_a_change():
        return None
    if not trainer.split.balanced or not (config.powers == AUTO or config.rebalance_every):
        return None
    saved = checkpointer.saved_shares()
    return saved if saved is not None and trainer.split.takes(saved) else None


def restore(checkpointer, trainer, log) -> int:
    """The step the latest good checkpoint continues from (0: none).

    A checkpoint holds the optimizer's learning rate, and the rate the run was
    given when it started. A resumed run given another rate now
    (`--learning_rate`, or a user's compiled optimizer) trains at it; given the same,
    it trains at the checkpoint's, which a callback may have changed since
    (ReduceLROnPlateau, LearningRateScheduler). A schedule follows the restored
    iteration count.
    """
    if checkpointer is None:
        return 0
    checkpointer.log = log
    given = None if schedule_of(trainer.model.optimizer) else learning_rate(trainer.model.optimizer)
    checkpointer.state.providers["given_learning_rate"] = lambda: given
    step = checkpointer.restore(log)
    saved = checkpointer.state.restored.get("given_learning_rate")
    if given is not None and saved != given:
        trainer.model.optimizer.learning_rate = given
    return step


def saved_result(plan: Plan, start_step: int) -> dict | None:
    """For a run resumed at or past its planned end: the result it saved (None if
    there is none: it stopped between its last checkpoint and its result).
    An end before the checkpoint's step is an error: those steps cannot be undone."""
    config = plan.config
    if plan.total_steps is not None and start_step > plan.total_steps:
        field, value = (
            ("epochs", config.epochs)
            if config.iterations is None and config.epochs is not None
            else ("iterations", plan.total_steps)
        )
        raise ConfigError(
            field,
            value,
            f"ends at iteration {plan.total_steps}, before the checkpoint of iteration "
            f"{start_step} in {config.model_dir}; train at least to {start_step}, or use "
            "another --model_dir",
        )
    try:
        with open(os.path.join(config.model_dir, "result.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def stream_iterator(plan: Plan, trainer, checkpointer, cursor):
    """The stream's iterator at the cursor's step, and what the banner says of it.

    A tf.data pipeline read by a host iterator has its position saved with every
    checkpoint, and a resume restores it there (with its shuffle buffers): no batch
    is read again; but not a position saved at or before a step the stream failed at
    (`bad_data`): that is read again to its step, as below. Arrays and a PyDataset
    are read on by index from the step's batch. Else, or from a checkpoint without a
    position, the stream is read again from its start and the trained batches are
    dropped.
    """
    stream, start_step = plan.train_data, cursor.step
    unsaved = streams.unsaved_state(stream.dataset) if stream.one_pass else None
    saves = checkpointer is not None and stream.one_pass and not trainer.split.fixed
    saves = saves and unsaved is None
    note = None
    failed = bad_data.distrusts_position(plan.config.model_dir, start_step) if saves else None
    restored = saves and start_step and checkpointer.saved_input() and failed is None
    if restored:
        iterator = trainer.distribute(stream.training_batches(0), marked=stream.marked)
        checkpointer.restore_input(iterator)
        note = f"the {stream.source} at the position saved with the checkpoint"
    else:
        iterator = trainer.distribute(
            stream.training_batches(start_step, cursor.passes),
            gather=stream.gather,
            marked=stream.marked,
        )
        if start_step and not stream.in_memory:  # (arrays: the step is the position)
            note = _read_on_note(stream, start_step, unsaved, failed)
    if saves:
        checkpointer.keep_input(iterator, restored=bool(restored))
    return iterator, note


def _read_on_note(stream, start_step: int, unsaved, failed) -> str:
    """What the banner says of a stream resumed at `start_step` without a saved position."""
    if stream.starting_at is not None:
        return f"the {stream.source} read on by index from step {start_step}'s batch"
    why = ""
    if unsaved:
        why = f", as its {unsaved} is not saved with a position"
    elif failed is not None:
        why = (
            f", not restored at the saved position: the stream failed at step "
            f"{failed}, and a position saved then holds the failure in its read-ahead"
        )
    return (
        f"the {stream.source} is read again from its start and its first "
        f"{start_step} batches dropped{why}"
        ": the same batches if it makes the same ones on every run"
    )
