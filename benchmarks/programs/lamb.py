"""LAMB after the gradient's allreduce (You et al. 2020), one trust ratio for the whole tensor, no bias
correction: two norms of full vectors, which sliced schedules compute as per-rank partial sums and an
allreduce of a scalar."""

from coconet import Local, Program, Replicated, allreduce, norm, sqrt, where

p = Program("lamb", dims=("N",))
g = p.tensor("g", ("N",), layout=Local)
w = p.tensor("w", ("N",), layout=Replicated)
m = p.tensor("m", ("N",), layout=Replicated)
v = p.tensor("v", ("N",), layout=Replicated)
lr, beta1, beta2, eps, wd = p.scalars("lr beta1 beta2 eps wd")

avg = allreduce(g)
m1 = beta1 * m + (1 - beta1) * avg
v1 = beta2 * v + (1 - beta2) * avg * avg
u = m1 / (sqrt(v1) + eps) + wd * w
wn, un = norm(w), norm(u)
ratio = where(wn > 0, where(un > 0, wn / un, 1.0), 1.0)
p.update(m, m1)
p.update(v, v1)
p.update(w, w - lr * ratio * u)
program = p
