"""A channel-parallel convolution: the second 3x3 convolution of a ResNet basic block (He et al. 2016) under
channel parallelism (Dryden et al. 2019, "Channel and Filter Parallelism for Large-Scale CNN Training", SC'19;
the convolutional twin of Megatron-LM's row-parallel GEMM).

Each rank holds a slice of the activation's channels, as a filter-parallel convolution before it leaves them,
and the matching input channels of the filters, so its convolution is a partial sum over its channels; the
allreduce completes it, then the bias (a batch norm folded into it), the block's residual and the ReLU follow.
"""

from coconet import Program, Replicated, Sliced, allreduce, conv2d, maximum

p = Program("conv_block", dims=("B", "C", "H", "W"))
x = p.tensor("x", ("B", "C", "H", "W"), layout=Sliced(1))  # this rank's channels of the activation
w = p.tensor("w", ("C", "C", 3, 3), layout=Sliced(1))  # every filter's weights on those input channels
b = p.tensor("b", ("C", 1, 1), layout=Replicated)
r = p.tensor("r", ("B", "C", "H", "W"), layout=Replicated)  # the block's input, its shortcut

y = allreduce(conv2d(x, w, padding=1))
p.output("out", maximum(y + b + r, 0.0))
program = p
