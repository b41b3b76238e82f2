import numpy as np
import pytest

from tfdp.models import build_model, initial_weights


def test_lenet_is_the_tutorial_network():
    model = build_model("lenet")
    shapes = [tuple(w.shape) for w in model.weights]
    assert shapes == [
        (5, 5, 1, 20),
        (20,),
        (5, 5, 20, 50),
        (50,),
        (800, 500),
        (500,),
        (500, 10),
        (10,),
    ]
    assert model.count_params() == 431_080
    assert [layer.__class__.__name__ for layer in model.layers] == [
        "Conv2D",
        "MaxPooling2D",
        "Conv2D",
        "MaxPooling2D",
        "Flatten",
        "Dense",
        "Dense",
    ]
    assert [
        getattr(layer, "activation", None).__name__
        for layer in model.layers
        if hasattr(layer, "activation")
    ] == ["tanh", "tanh", "tanh", "linear"]
    assert model(np.zeros((3, 28, 28, 1), np.float32)).shape == (3, 10)


def test_toy_mlp():
    model = build_model("toy", hidden_units=64)
    assert [tuple(w.shape) for w in model.weights] == [(128, 64), (64,), (64, 10), (10,)]
    assert model.layers[0].activation.__name__ == "relu"


@pytest.mark.parametrize("name", ["lenet", "toy"])
def test_tutorial_init(name):
    weights = initial_weights(name, "tutorial", seed=3)
    for kernel, bias in zip(weights[0::2], weights[1::2]):
        assert np.all(np.abs(kernel) <= 0.1)
        assert kernel.std() == pytest.approx(0.2 / np.sqrt(12), rel=0.1)  # U(-0.1, 0.1)
        assert not np.any(bias)
    # Each layer draws its own numbers.
    assert not np.allclose(weights[0].ravel()[:10], weights[2].ravel()[:10])


@pytest.mark.parametrize("init", ["tutorial", "keras"])
def test_same_seed_same_weights_other_seed_other_weights(init):
    a, b, c = (initial_weights("lenet", init, seed) for seed in (7, 7, 8))
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a[0], c[0])


def test_keras_init_differs_from_tutorial():
    keras_kernel = initial_weights("lenet", "keras", 0)[4]
    # Glorot uniform on the 800x500 dense layer: limit sqrt(6 / 1300) ~ 0.068.
    assert np.abs(keras_kernel).max() <= np.sqrt(6 / 1300) + 1e-6
    assert np.abs(keras_kernel).max() > 0.06
