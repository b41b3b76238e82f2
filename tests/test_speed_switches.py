"""--jit_compile and --precision: every mode makes the update `single` makes with the same
switch, and the switch takes effect (an XLA program; float16/bfloat16 layers over float32
variables, loss scaling for float16). Refused combinations are one line, exit 2."""

import os
import sys

import helpers
import keras
import numpy as np
import pytest
from helpers import CPUS, launch, refusal, train

from tfdp import Config
from tfdp.models import built_in, initial_weights

BATCH = 100
SEED = 5
STEPS = 3

# Each switch, and the largest difference from `single` allowed for a weight, as a
# fraction of that weight tensor's largest change over the steps. float32 without
# XLA: float rounding, as in test_equivalence (at most 2e-5 of the change). With XLA,
# its CPU convolutions round differently by batch size on some hosts: on a 2-core
# AVX2 host, shards of 25 or 34 examples made an update that differed from one made
# on shards of 50 or 100 by up to 0.009 of the change in the first convolution's
# kernel (and XLA's differed from oneDNN's by 0.019); 2e-5 on an AVX-512 host.
# bfloat16 keeps 8 bits of mantissa, float16 11: a different split of the batch
# rounds different activations and partial sums, and the updates differ by a few
# percent of their size (measured: at most 0.059 for bfloat16, 0.033 for float16).
# A shard whose gradient is lost or counted twice changes the update by its share of
# the batch, 1/6 or more in these cases.
SWITCHES = {
    "jit": ({"jit_compile": True}, 0.03),
    "bfloat16": ({"precision": "mixed_bfloat16"}, 0.12),
    "float16": ({"precision": "mixed_float16"}, 0.1),
    "jit+bfloat16": ({"jit_compile": True, "precision": "mixed_bfloat16"}, 0.12),
}

MODES = [
    ("mirrored", CPUS[:3], (), {}),  # 100 = 34 + 33 + 33
    ("weighted", CPUS[:2], (1, 5), {}),
    ("weighted", CPUS[:4], (3, 1, 1, 1), {"reduce": "allreduce"}),
    # the host clock in the step, around the compiled forward and backward
    ("weighted", CPUS[:2], (1, 5), {"rebalance_every": 2}),
]


def train_steps(mode, devices, powers, images, **options):
    config = Config(
        mode=mode, devices=",".join(devices), powers=powers, batch_size=BATCH, seed=SEED, **options
    )
    model = built_in(config, build=True)
    start = model.get_weights()
    trainer, _ = helpers.train_steps(config, devices, images, STEPS, model)
    return trainer, start


@pytest.fixture(scope="module")
def singles(images):
    """`single` with each switch: (trainer, initial weights)."""
    return {
        name: train_steps("single", CPUS[:1], (), images, **switch)
        for name, (switch, _) in SWITCHES.items()
    }


# Every switch on the all-reduce (mirrored) and on the host-timed weighted step; the
# other splits with XLA, the switch that changes the step's program the most.
CASES = [
    (switch, *mode)
    for switch in SWITCHES
    for mode in MODES
    if switch == "jit" or mode in (MODES[0], MODES[3])
]


@pytest.mark.slow
@pytest.mark.parametrize("switch, mode, devices, powers, options", CASES)
def test_every_mode_makes_the_update_of_single(
    switch, mode, devices, powers, options, images, singles
):
    settings, tolerance = SWITCHES[switch]
    trainer, _ = train_steps(mode, devices, powers, images, **settings, **options)
    single, start = singles[switch]
    for got, want, first in zip(trainer.model.get_weights(), single.model.get_weights(), start, strict=True):
        change = np.abs(want - first).max()
        assert change > 1e-4  # the steps moved every weight tensor
        assert np.abs(got - want).max() <= tolerance * change


@pytest.mark.slow
def test_jit_compile_runs_the_step_as_an_xla_program(singles, images):
    trainer, _ = train_steps("single", CPUS[:1], (), images, jit_compile=True, chains=1)
    assert trainer.jit_compile
    x = images.images[:BATCH].astype(np.float32) / 255.0
    function = trainer._replicas_train  # the model's own train_step in the strategy, by XLA
    hlo = function.experimental_get_compiler_ir((x, images.labels[:BATCH]))(stage="hlo")
    assert "convolution(" in hlo  # LeNet's convolutions, lowered by XLA
    # the evaluation step too, as Keras' evaluate compiles it (its metrics round as Keras')
    hlo = trainer._replicas_test.experimental_get_compiler_ir((x, images.labels[:BATCH]))(stage="hlo")
    assert "convolution(" in hlo
    plain, _ = singles["bfloat16"]
    assert not plain.jit_compile
    assert not hasattr(plain._replicas_train, "experimental_get_compiler_ir")
    # XLA's kernels round differently from oneDNN's: the same math, not the same program
    float32, _ = train_steps("single", CPUS[:1], (), images, chains=1)
    differences = [
        np.abs(a - b).max() for a, b in zip(trainer.model.get_weights(), float32.model.get_weights())
    ]
    assert 0 < max(differences) < 1e-2


@pytest.mark.slow
@pytest.mark.parametrize(
    "switch, compute",
    [("bfloat16", "bfloat16"), ("float16", "float16"), ("jit+bfloat16", "bfloat16")],
)
def test_precision_sets_the_layers_policy_in_every_copy(switch, compute, images):
    settings, _ = SWITCHES[switch]
    trainer, _ = train_steps("weighted", CPUS[:2], (1, 3), images, **settings)
    for model in [trainer.model]:
        weighted = [layer for layer in model.layers if layer.weights]
        assert len(weighted) == 4  # LeNet's two convolutions and two dense layers
        *layers, logits = model.layers
        assert {layer.compute_dtype for layer in layers} == {compute}
        assert logits.compute_dtype == "float32" and not logits.weights
        assert {v.dtype for v in model.weights} == {"float32"}
    scaled = isinstance(trainer.model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert scaled == (compute == "float16")
    # the policy was the run's only: what is built afterwards is float32
    assert keras.config.dtype_policy().name == "float32"
    assert keras.layers.Dense(2).compute_dtype == "float32"


@pytest.mark.slow
def test_float32_has_no_loss_scaling(singles):
    trainer, _ = singles["jit"]
    assert not isinstance(trainer.model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert {layer.compute_dtype for layer in trainer.model.layers} == {"float32"}


# ---------------------------------------------------------------- through the CLI

TOY = ["--model=toy", "--batch_size=256", "--iterations=3", "--progress=never"]
FLAG_SETTINGS = {
    "--jit_compile": {"jit_compile": True},
    "--precision=mixed_bfloat16": {"precision": "mixed_bfloat16"},
    "--precision=mixed_float16": {"precision": "mixed_float16"},
}


def exported(model_dir):
    return keras.models.load_model(os.path.join(model_dir, "model.keras"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags, compute, tolerance",
    [
        (["--precision=mixed_bfloat16"], "bfloat16", 0.12),
        (["--precision=mixed_float16", "--jit_compile"], "float16", 0.1),
    ],
)
def test_the_flags_two_workers_make_the_update_of_single(flags, compute, tolerance, tmp_path):
    settings = {k: v for flag in flags for k, v in FLAG_SETTINGS[flag].items()}
    fitted, _ = train(
        Config(
            model="toy",
            batch_size=256,
            iterations=3,
            model_dir=str(tmp_path / "single"),
            **settings,
        )
    )
    # XLA compiled the run's forward and backward exactly when --jit_compile is given
    assert fitted["jit_compile"] == ("--jit_compile" in flags)
    workers = launch(*TOY, *flags, f"--model_dir={tmp_path / 'workers'}", cwd=tmp_path, timeout=300)
    assert workers.returncode == 0, workers.stderr
    got, want = exported(tmp_path / "workers"), exported(tmp_path / "single")
    for model in (got, want):
        *layers, logits = model.layers
        assert {layer.compute_dtype for layer in layers} == {compute}
        assert logits.compute_dtype == "float32"
        assert {v.dtype for v in model.weights} == {"float32"}
        scaled = isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
        assert scaled == (compute == "float16")
    # the toy model's initial weights (seed 0, as the runs) do not depend on the flags
    initial = initial_weights("toy")
    for g, w, first in zip(got.get_weights(), want.get_weights(), initial, strict=True):
        change = np.abs(w - first).max()
        assert change > 1e-4
        assert np.abs(g - w).max() <= tolerance * change


def test_refused_flags_are_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _, line = refusal("--precision=float64", "--iterations=1", f"--model_dir={tmp_path / 'run'}")
    assert line.startswith(
        "tfdp: error: flag --precision=float64: value should be one of "
        "<float32|mixed_bfloat16|mixed_float16>"
    ), line
    assert not (tmp_path / "run").exists()


USER_MODEL = """
import keras


def make():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((128,))
    hidden = keras.layers.Dense(32, activation="relu")(inputs)
    logits = keras.layers.Dense(10)(hidden)
    outputs = keras.layers.Activation("linear", dtype="float32")(logits)  # float32 logits
    model = keras.Model(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model
"""


@pytest.mark.slow
def test_the_switches_build_a_users_model_and_every_mode_makes_the_single_update(tmp_path):
    # A function that knows nothing of precision: tfdp builds it under the policy, and
    # Keras' compile adds the loss scaling of float16.
    (tmp_path / "user.py").write_text(USER_MODEL)
    common = dict(
        model=f"{tmp_path / 'user.py'}:make",
        dataset="toy",
        batch_size=100,
        iterations=3,
        precision="mixed_float16",
        jit_compile=True,
    )
    runs = {}
    for name, mode in (
        ("single", {"mode": "single"}),
        ("weighted", {"mode": "weighted", "devices": "cpu:0,cpu:1", "powers": (1, 3)}),
    ):
        train(Config(**common, **mode, model_dir=str(tmp_path / name)))
        runs[name] = keras.models.load_model(tmp_path / name / "model.keras")
    single, weighted = runs["single"], runs["weighted"]
    assert [layer.dtype_policy.name for layer in single.layers[1:]] == [
        "mixed_float16",
        "mixed_float16",
        "float32",
    ]
    assert all(v.dtype == "float32" for v in single.weights)
    sys.path.insert(0, str(tmp_path))
    try:
        import user
    finally:
        sys.path.remove(str(tmp_path))
    initial = user.make().get_weights()
    assert keras.config.dtype_policy().name == "float32"  # the import built it as written

    from tfdp import fit
    from tfdp.data.mnist import make_toy_data

    toy = make_toy_data(0, num_examples=200)
    fitted = fit(
        user.make, toy.images, toy.labels, batch_size=100, iterations=1, precision="mixed_float16"
    ).result
    assert isinstance(fitted.model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert fitted.model.layers[1].dtype_policy.name == "mixed_float16"
    assert keras.config.dtype_policy().name == "float32"  # restored after building
    for got, want, first in zip(weighted.get_weights(), single.get_weights(), initial, strict=True):
        change = np.abs(want - first).max()
        assert change > 1e-4
        assert np.abs(got - want).max() <= SWITCHES["float16"][1] * change


def test_precision_needs_a_function_not_a_model_object():
    import tfdp
    from tfdp.errors import ConfigError

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.zeros((8, 3), np.float32), np.zeros((8, 2), np.float32)
    with pytest.raises(ConfigError, match="needs a function that builds the model") as info:
        tfdp.fit(model, x, y, precision="mixed_bfloat16", batch_size=4, iterations=1)
    assert info.value.field == "precision"
