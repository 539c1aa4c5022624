"""Lion (Chen et al. 2023): the sign of an interpolation of momentum and gradient, decoupled weight decay.
Gradients averaged over the ranks (``op="avg"``). torch has no Lion."""

from coconet import Local, Program, Replicated, allreduce, where

p = Program("lion_avg", dims=("N",))
g = p.tensor("g", ("N",), layout=Local)
w = p.tensor("w", ("N",), layout=Replicated)
m = p.tensor("m", ("N",), layout=Replicated)
lr, beta1, beta2, weight_decay = p.scalars("lr beta1 beta2 weight_decay")

grad = allreduce(g, op="avg")
c = beta1 * m + (1 - beta1) * grad
sign = where(c > 0, 1.0, where(c < 0, -1.0, 0.0))
p.update(w, w * (1 - lr * weight_decay) - lr * sign)
p.update(m, beta2 * m + (1 - beta2) * grad)

defaults = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.0}
program = p
