"""A GPT layer's epilogue under Megatron-LM's sequence parallelism (Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", §4.2.2).

Tensor parallelism splits the MLP's second GEMM by rows (row-parallel, as ``megatron_mlp``): each rank's
product is a partial sum. Sequence parallelism completes it with a reduce_scatter along the sequence instead
of an allreduce, so that bias, dropout, the residual and the next LayerNorm run on each rank's slice of the
sequence; an all_gather then hands the normalised activation whole to the next column-parallel GEMM, and the
residual stream stays sliced. Tensors are sequence-first, ``[s, b, h]``, as Megatron-LM lays them out.
"""

from coconet import Program, Replicated, Sliced, all_gather, dropout, layer_norm, matmul, reduce_scatter

p = Program("gpt_layer_sp", dims=("S", "B", "H"))
x = p.tensor("x", ("S", "B", "4*H"), layout=Sliced(-1))  # the MLP's activation, this rank's columns
w = p.tensor("w", ("4*H", "H"), layout=Sliced(0))  # the second GEMM's weight, the matching rows
b = p.tensor("b", ("H",), layout=Replicated)
r = p.tensor("r", ("S", "B", "H"), layout=Sliced(0))  # the residual stream, sliced along the sequence
gamma = p.tensor("gamma", ("H",), layout=Replicated)
beta = p.tensor("beta", ("H",), layout=Replicated)
seed = p.scalar("seed", dtype="int64")

y = reduce_scatter(matmul(x, w), dim=0)
h = dropout(y + b, 0.1, seed) + r
p.output("residual", h)
p.output("out", all_gather(layer_norm(h, gamma, beta, eps=1e-5)))
program = p
