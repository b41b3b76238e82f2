"""tfdp's own features as hooks of the training loop (`loop.Hook`), in the order
`default` lists them (and the loop calls them):

    membership.py   Membership: under tfdp-launch, this start's entry in the cluster's history
    finite.py       FiniteGuard: a non-finite loss or weights stop the run, never saved
    report.py       TutorialLog: the tutorial's lines and the run's time;
                    ProgressLine: the live progress line
    balancing.py    Rebalance: re-splits the batch from the devices' step times
    keras.py        KerasCallbacks: a user's Keras callbacks, as `Model.fit` calls them
    evaluation.py   Evaluation: the test set every `eval_every` steps and at the end
    summaries.py    TrainSummaries: TensorBoard scalars at the logged steps
    checkpointing.py Checkpoints: saves every `checkpoint_every` steps and at the end
    stopping.py     StopOnSignal: SIGTERM or SIGINT saves the step and stops
"""

from __future__ import annotations

from tfdp.run.hooks.balancing import Rebalance
from tfdp.run.hooks.checkpointing import Checkpoints
from tfdp.run.hooks.evaluation import Evaluation
from tfdp.run.hooks.finite import FiniteGuard
from tfdp.run.hooks.keras import KerasCallbacks
from tfdp.run.hooks.membership import Membership, changes
from tfdp.run.hooks.report import ProgressLine, TutorialLog
from tfdp.run.hooks.stopping import StopOnSignal
from tfdp.run.hooks.summaries import TrainSummaries
from tfdp.run.loop import Hooks, Run
from tfdp.run.observe import Summaries


def default(
    state: Run,
    checkpointer,
    signals,
    probe,
    callbacks=None,
    verbose="auto",
    validation=None,
    more=(),
) -> tuple[Hooks, KerasCallbacks | None]:
    """The hooks of a run (`training.run`), in the order the loop calls them, and the
    KerasCallbacks among them (None without `callbacks`: the run then has no History).

    state: the run, set up (its plan, trainer, log and progress line).
    checkpointer: the run's `checkpoints.Checkpointer` (None: no `model_dir`).
    signals: the run's `signals.StopSignals`.
    probe: where rebalancing carries on from (`balancers.DeviceBalancer.set_up`).
    callbacks, verbose, validation: `training.run`'s, for `KerasCallbacks`.
    more: `training.run`'s own hooks, called last.
    """
    plan, trainer = state.plan, state.trainer
    config, chief = plan.config, trainer.exchange.is_chief
    summaries = Summaries(config.model_dir) if config.model_dir and chief else None
    guard = FiniteGuard(checkpointer) if config.finite_guard else None
    checkpoints = Checkpoints(checkpointer, guard) if checkpointer else None
    rebalancing = (
        trainer.balancer.rebalancing(config.rebalance_every, state.say, probe)
        if len(plan.devices) > 1
        else None
    )
    keras_callbacks = None
    if callbacks is not None:
        keras_callbacks = KerasCallbacks(
            callbacks, verbose, plan.final_epoch, validation, chief=chief
        )
        if checkpointer:  # the callbacks' state is saved and restored with the run's
            keras_callbacks.saved_state = checkpointer.state.restored.get("keras")
            checkpointer.state.providers["keras"] = keras_callbacks.state
    history = changes()
    hooks = Hooks(
        [
            Membership(history, config.model_dir, chief) if history else None,
            guard,
            TutorialLog(running=keras_callbacks is not None),
            Rebalance(rebalancing) if rebalancing else None,
            ProgressLine(state.progress) if state.progress else None,
            keras_callbacks,
            Evaluation(summaries),
            TrainSummaries(summaries) if summaries else None,
            checkpoints,
            StopOnSignal(signals, checkpoints),
            *more,
        ]
    )
    return hooks, keras_callbacks
