"""Adan (Xie et al. 2022) after the gradient's allreduce: three moments and the previous gradient."""

from coconet import Local, Program, Replicated, allreduce, sqrt

p = Program("adan", dims=("N",))
g = p.tensor("g", ("N",), layout=Local)
w = p.tensor("w", ("N",), layout=Replicated)
m = p.tensor("m", ("N",), layout=Replicated)
d = p.tensor("d", ("N",), layout=Replicated)
n = p.tensor("n", ("N",), layout=Replicated)
gp = p.tensor("gp", ("N",), layout=Replicated)
lr, b1, b2, b3, eps, wd = p.scalars("lr b1 b2 b3 eps wd")

grad = allreduce(g)
diff = grad - gp
m1 = (1 - b1) * m + b1 * grad
d1 = (1 - b2) * d + b2 * diff
u = grad + (1 - b2) * diff
n1 = (1 - b3) * n + b3 * u * u
p.update(m, m1)
p.update(d, d1)
p.update(n, n1)
p.update(gp, grad)
p.update(w, (w - lr * (m1 + (1 - b2) * d1) / (sqrt(n1) + eps)) / (1 + lr * wd))
program = p
