"""Your own model on tfdp: a small CNN with batch norm, dropout, L2 and AdamW.

From the command line (MNIST from tensorflow-datasets, or offline from IDX files):

    tfdp --model=examples/mnist_cnn.py:make_model --mode=weighted --logical_cpus=2 \
        --powers=1,3 --batch_size=256 --epochs=1 --mnist_dir=../shared/data/mnist

From Python:

    python examples/mnist_cnn.py --mnist_dir=../shared/data/mnist
"""

import keras


def make_model() -> keras.Model:
    """A compiled CNN for 28x28x1 images in [0, 1] and integer labels 0-9."""
    l2 = keras.regularizers.L2(1e-4)
    model = keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(32, 3, use_bias=False, kernel_regularizer=l2),
            keras.layers.BatchNormalization(momentum=0.9),  # moving statistics settle in an epoch
            keras.layers.ReLU(),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(64, 3, activation="relu", kernel_regularizer=l2),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dropout(0.25),
            keras.layers.Dense(128, activation="relu", kernel_regularizer=l2),
            keras.layers.Dense(10),
        ],
        name="mnist_cnn",
    )
    model.compile(
        optimizer=keras.optimizers.AdamW(learning_rate=2e-3, weight_decay=1e-4),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def main() -> None:
    import argparse

    import numpy as np

    import tfdp
    from tfdp.data.mnist import load_mnist

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--mnist_dir", help="the four MNIST IDX files (default: tensorflow-datasets)"
    )
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()

    tfdp.configure_logical_devices(logical_cpus=2)  # two CPU devices stand in for CPU + GPU
    train, test = (load_mnist(split, mnist_dir=args.mnist_dir) for split in ("train", "test"))
    x, x_test = (np.float32(a.images) / 255 for a in (train, test))
    model = make_model()
    # model.fit(x, train.labels, batch_size=256, epochs=..., validation_data=..., callbacks=...)
    history = tfdp.fit(
        model,
        x,
        train.labels,
        batch_size=256,
        epochs=args.epochs,
        validation_data=(x_test, test.labels),
        callbacks=[keras.callbacks.EarlyStopping(monitor="val_accuracy", patience=2)],
        mode="weighted",
        devices="cpu:0,cpu:1",
        powers=(1, 3),
    )
    print(f"test accuracy {history.history['val_accuracy'][-1]:.4f}; trained {model.name}")


if __name__ == "__main__":
    main()
