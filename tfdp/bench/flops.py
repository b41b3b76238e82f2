"""LeNet's arithmetic per image, as tfdp-bench counts it against the matmul rate."""

# LeNet-5 on a 28x28 image, multiply-adds of each layer's forward pass.
LENET_FORWARD_MACS = (
    24 * 24 * 20 * 5 * 5 * 1  # conv1: 24x24 outputs x 20 filters x 5x5x1
    + 8 * 8 * 50 * 5 * 5 * 20  # conv2: 8x8 outputs x 50 filters x 5x5x20
    + 800 * 500  # dense 500
    + 500 * 10  # dense 10
)
FORWARD_FLOPS = 2 * LENET_FORWARD_MACS  # ~4.6 MFLOP
TRAIN_FLOPS = 3 * FORWARD_FLOPS  # forward + backward (gradients of inputs and of weights)
