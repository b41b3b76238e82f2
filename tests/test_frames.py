"""From the loop's call of a step to the model's own `train_step`: few of tfdp's frames
(Keras' own fit has three of its own there), so that a stack trace from a user's step
reads as the user's."""

import pathlib
import traceback

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import CPUS

import tfdp
from tfdp import Config
from tfdp.engine.modes import build_trainer

PACKAGE = str(pathlib.Path(tfdp.__file__).parent)


class StepError(Exception):
    pass


class Failing(keras.Model):
    """A functional model whose train_step fails, as a user's step may."""

    def train_step(self, data):
        raise StepError("the user's step")


def tfdps_frames(stack) -> list[str]:
    """tfdp's frames of a stack trace from the trainer's `train_step` on (the loop calls it)."""
    names = [(frame.filename, frame.name) for frame in stack]
    start = next(i for i, (file, name) in enumerate(names)
                 if name == "train_step" and file.startswith(PACKAGE))
    return [f"{pathlib.Path(file).name}:{name}" for file, name in names[start:]
            if file.startswith(PACKAGE)]


@pytest.mark.parametrize("mode, devices, powers", [("mirrored", CPUS[:2], ()),
                                                   ("weighted", CPUS[:2], (1, 3))])
def test_at_most_five_of_tfdps_frames_between_the_loop_and_the_models_step(mode, devices, powers):
    inputs = keras.Input((4,))
    model = Failing(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    config = Config(mode=mode, devices=",".join(devices), powers=powers, batch_size=8, model="toy")
    trainer = build_trainer(config, devices, [4] * len(devices) if not powers else [2, 6], model)
    try:
        x = np.ones((16, 4), np.float32)
        dataset = tf.data.Dataset.from_tensor_slices((x, x[:, :2])).batch(8)
        with pytest.raises(StepError) as raised:
            trainer.train_step(trainer.distribute(dataset))
    finally:
        trainer.close()
    stack = traceback.extract_tb(raised.value.__traceback__)
    assert stack[-1].name == "train_step" and stack[-1].filename == __file__  # the user's step
    frames = tfdps_frames(stack)
    assert frames[0] == "trainer.py:train_step" and frames[-1] == "strategy.py:weighed", frames
    assert len(frames) <= 5, frames
