"""Random image datasets written as TFRecord files, for the benchmarks that stream them."""

from __future__ import annotations

import os

FILES = 8  # TFRecord files a dataset is written in
CHUNK = 4096  # examples drawn at a time


def write_records(directory: str, examples: int, image_shape, classes=10, seed=0) -> list[str]:
    """`examples` random examples (uint8 images of `image_shape`, int64 labels below
    `classes`) in FILES TFRecord files, example i in file i mod FILES."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    paths = [os.path.join(directory, f"train-{i}.tfrecord") for i in range(FILES)]
    writers = [tf.io.TFRecordWriter(path) for path in paths]
    for begin in range(0, examples, CHUNK):
        count = min(CHUNK, examples - begin)
        images = rng.integers(0, 256, (count, *image_shape), dtype=np.uint8)
        labels = rng.integers(0, classes, count)
        for i in range(count):
            feature = {
                "image": tf.train.Feature(
                    bytes_list=tf.train.BytesList(value=[images[i].tobytes()])
                ),
                "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[labels[i]])),
            }
            example = tf.train.Example(features=tf.train.Features(feature=feature))
            writers[(begin + i) % FILES].write(example.SerializeToString())
    for writer in writers:
        writer.close()
    return paths


def parse(record, image_shape):
    """A serialized example -> (float32 image of `image_shape` in [0, 1], int64 label)."""
    import tensorflow as tf

    parsed = tf.io.parse_single_example(
        record,
        {
            "image": tf.io.FixedLenFeature([], tf.string),
            "label": tf.io.FixedLenFeature([], tf.int64),
        },
    )
    image = tf.reshape(tf.io.decode_raw(parsed["image"], tf.uint8), image_shape)
    return tf.cast(image, tf.float32) / 255.0, parsed["label"]
