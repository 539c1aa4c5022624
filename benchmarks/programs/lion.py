"""Lion (Chen et al. 2023) after the gradient's averaging allreduce: the sign of an interpolation of momentum and
gradient, decoupled weight decay; the sign written with comparisons and where."""

from coconet import Local, Program, Replicated, allreduce, where

p = Program("lion", dims=("N",))
g = p.tensor("g", ("N",), layout=Local)
w = p.tensor("w", ("N",), layout=Replicated)
m = p.tensor("m", ("N",), layout=Replicated)
lr, beta1, beta2, wd = p.scalars("lr beta1 beta2 wd")
grad = allreduce(g, op="avg")
c = beta1 * m + (1 - beta1) * grad
sign = where(c > 0, 1.0, where(c < 0, -1.0, 0.0))
p.update(w, w * (1 - lr * wd) - lr * sign)
p.update(m, beta2 * m + (1 - beta2) * grad)
program = p
