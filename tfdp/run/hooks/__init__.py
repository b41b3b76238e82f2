"""tfdp's own features as hooks of the training loop (`loop.Hook`), in the order
`training.run` calls them:

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
