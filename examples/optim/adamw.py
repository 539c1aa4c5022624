"""AdamW (Loshchilov & Hutter 2019) as ``torch.optim.AdamW`` computes it: the weights decayed apart from the
gradient, then Adam's bias-corrected step. Gradients averaged over the ranks (``op="avg"``)."""

from coconet import Local, Program, Replicated, allreduce, sqrt

p = Program("adamw", dims=("N",))
g = p.tensor("g", ("N",), layout=Local)
w = p.tensor("w", ("N",), layout=Replicated)
m = p.tensor("m", ("N",), layout=Replicated)
v = p.tensor("v", ("N",), layout=Replicated)
lr, beta1, beta2, eps, weight_decay, t = p.scalars("lr beta1 beta2 eps weight_decay t")

grad = allreduce(g, op="avg")
m1 = beta1 * m + (1 - beta1) * grad
v1 = beta2 * v + (1 - beta2) * grad * grad
p.update(m, m1)
p.update(v, v1)
p.update(w, w * (1 - lr * weight_decay) - lr * (m1 / (1 - beta1**t)) / (sqrt(v1 / (1 - beta2**t)) + eps))

defaults = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 1e-2}
program = p
