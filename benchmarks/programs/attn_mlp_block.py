"""A tensor-parallel transformer block's two halves after attention: the attention output projection
(row-parallel matmul, allreduce, bias, dropout, residual), then the MLP (column-parallel matmul, a
sigmoid-approximated GELU, row-parallel matmul, allreduce, bias, dropout, residual onto the first half's
output, which is read twice: by the MLP's matmul and by its residual)."""

from coconet import Program, Replicated, Sliced, allreduce, dropout, exp, matmul

p = Program("attn_mlp_block", dims=("B", "S", "H", "F"))
x = p.tensor("x", ("B", "S", "H"), layout=Replicated)
attn = p.tensor("attn", ("B", "S", "H"), layout=Sliced(2))  # each rank's heads' context vectors
wo = p.tensor("wo", ("H", "H"), layout=Sliced(0))
bo = p.tensor("bo", ("H",), layout=Replicated)
w1 = p.tensor("w1", ("H", "F"), layout=Sliced(1))
w2 = p.tensor("w2", ("F", "H"), layout=Sliced(0))
b2 = p.tensor("b2", ("H",), layout=Replicated)
h = dropout(allreduce(matmul(attn, wo)) + bo, 0.1, 3) + x
u = matmul(h, w1)
y = dropout(allreduce(matmul(u / (1 + exp(-u)), w2)) + b2, 0.1, 5) + h
p.output("out", y)
program = p
