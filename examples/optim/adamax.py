"""Adamax (Kingma & Ba 2015, §7.1) as ``torch.optim.Adamax`` computes it: the second moment an exponentially
weighted infinity norm. Gradients averaged over the ranks (``op="avg"``)."""

from coconet import Local, Program, Replicated, abs, allreduce, maximum

p = Program("adamax", dims=("N",))
g = p.tensor("g", ("N",), layout=Local)
w = p.tensor("w", ("N",), layout=Replicated)
m = p.tensor("m", ("N",), layout=Replicated)
u = p.tensor("u", ("N",), layout=Replicated)
lr, beta1, beta2, eps, weight_decay, t = p.scalars("lr beta1 beta2 eps weight_decay t")

grad = allreduce(g, op="avg") + weight_decay * w
m1 = beta1 * m + (1 - beta1) * grad
u1 = maximum(beta2 * u, abs(grad) + eps)
p.update(m, m1)
p.update(u, u1)
p.update(w, w - (lr / (1 - beta1**t)) * m1 / u1)

defaults = {"lr": 2e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}
program = p
