"""Under tfdp-launch's supervision: the changes of the cluster's members, in the result.

The launcher gives every start of the cluster the history of its changes in
TFDP_MEMBERSHIP (`cluster.elastic`): for each, when it happened (the launcher's
clock), its cause and the members it started. After the first step this start
trains, the chief adds what only the workers know, the step the start resumed
from and the seconds from the change to that trained step, and keeps the
history in model_dir/membership.json: a start whose workers died before a
checkpoint is still listed there. The result's "membership" is that history.
"""

from __future__ import annotations

import json
import os
import time

from tfdp.cluster.workers import MEMBERSHIP
from tfdp.run.loop import Hook
from tfdp.storage import write_atomically

FILE = "membership.json"


def changes(environ=os.environ) -> list[dict] | None:
    """The history the launcher gave this process (None: not under tfdp-launch's supervision)."""
    text = environ.get(MEMBERSHIP)
    if not text:
        return None
    try:
        history = json.loads(text)
    except ValueError:
        return None
    return history if isinstance(history, list) and history else None


def after_a_change(environ=os.environ) -> bool:
    """Whether this start of the cluster follows a change of members (a restart)."""
    history = changes(environ)
    return bool(history) and history[-1].get("restart", 0) > 0


class Membership(Hook):
    """At the first trained step: this start's entry, in the history and the result.

    history: `changes()`; model_dir: where the chief keeps the history (None: nowhere).
    """

    def __init__(self, history: list[dict], model_dir: str | None, chief: bool):
        self.history, self.model_dir, self.chief = history, model_dir, chief
        self.done = False

    def on_step_end(self, run, step):
        if not self.done:
            self.record(run, time.time())

    def on_train_end(self, run):
        if not self.done:  # it resumed at the end: no step to train
            self.record(run, None)

    def record(self, run, trained: float | None) -> None:
        self.done = True
        kept = self._kept()
        entries = []
        for change in self.history:
            entry = kept.get(change["at"]) or {
                **change,
                "workers": len(change["members"]),
                "step": None,  # its workers trained no step, or died before saying so
                "seconds_to_step": None,
            }
            entries.append(entry)
        seconds = None if trained is None else round(trained - entries[-1]["at"], 3)
        entries[-1].update(step=run.start_step, seconds_to_step=seconds)
        entries.extend(
            entry for at, entry in kept.items() if all(c["at"] != at for c in self.history)
        )
        entries.sort(key=lambda entry: entry["at"])
        run.result["membership"] = entries
        if self.chief and self.model_dir:
            write_atomically(
                os.path.join(self.model_dir, FILE), json.dumps(entries, indent=1) + "\n"
            )

    def _kept(self) -> dict[float, dict]:
        """The history model_dir holds, by the time of each change."""
        if not self.model_dir:
            return {}
        try:
            with open(os.path.join(self.model_dir, FILE)) as file:
                return {entry["at"]: entry for entry in json.load(file)}
        except (OSError, ValueError, KeyError, TypeError):
            return {}
