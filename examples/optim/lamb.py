"""LAMB (You et al. 2020): Adam's bias-corrected step plus decoupled weight decay, scaled by the trust ratio
``norm(w) / norm(u)``. Gradients averaged over the ranks (``op="avg"``). torch has no LAMB.

The norms are over the whole flat buffer the optimizer steps (one param group of one dtype): for a trust ratio
per layer, as the paper has it, give each layer a param group of its own."""

from coconet import Local, Program, Replicated, allreduce, norm, sqrt

p = Program("lamb_avg", dims=("N",))
g = p.tensor("g", ("N",), layout=Local)
w = p.tensor("w", ("N",), layout=Replicated)
m = p.tensor("m", ("N",), layout=Replicated)
v = p.tensor("v", ("N",), layout=Replicated)
lr, beta1, beta2, eps, weight_decay, t = p.scalars("lr beta1 beta2 eps weight_decay t")

grad = allreduce(g, op="avg")
m1 = beta1 * m + (1 - beta1) * grad
v1 = beta2 * v + (1 - beta2) * grad * grad
u = (m1 / (1 - beta1**t)) / (sqrt(v1 / (1 - beta2**t)) + eps) + weight_decay * w
p.update(m, m1)
p.update(v, v1)
p.update(w, w - lr * (norm(w) / norm(u)) * u)

defaults = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-6, "weight_decay": 1e-2}
program = p
