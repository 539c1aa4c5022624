"""Model-parallel (Megatron-LM) MLP output layer (Shoeybi et al. 2019; CoCoNet §6.2).

The row-parallel second GEMM: each rank holds a slice of the activation along
the hidden dim and the matching rows of the weight, so its product is a partial
sum; the allreduce completes it, then bias, dropout and the residual follow.
"""

from coconet import Program, Replicated, Sliced, allreduce, dropout, matmul

p = Program("megatron_mlp", dims=("B", "S", "H"))
x = p.tensor("x", ("B", "S", "4*H"), layout=Sliced(-1))
w = p.tensor("w", ("4*H", "H"), layout=Sliced(0))
b = p.tensor("b", ("H",), layout=Replicated)
r = p.tensor("r", ("B", "S", "H"), layout=Replicated)
seed = p.scalar("seed", dtype="int64")

y = allreduce(matmul(x, w))
out = dropout(y + b, 0.1, seed) + r
p.output("out", out)
program = p
