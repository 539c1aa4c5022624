"""A tensor-parallel MLP block with a sigmoid-approximated GELU (x * sigmoid(1.702 x)): column-parallel
matmul, GELU, row-parallel matmul, allreduce, bias, dropout, residual."""

from coconet import Program, Replicated, Sliced, allreduce, dropout, exp, matmul

p = Program("gelu_mlp", dims=("B", "S", "H", "F"))
x = p.tensor("x", ("B", "S", "H"), layout=Replicated)
w1 = p.tensor("w1", ("H", "F"), layout=Sliced(1))
w2 = p.tensor("w2", ("F", "H"), layout=Sliced(0))
b = p.tensor("b", ("H",), layout=Replicated)
h = matmul(x, w1)
a = h / (1 + exp(-1.702 * h))
y = allreduce(matmul(a, w2))
p.output("out", dropout(y + b, 0.1, 7) + x)
program = p
