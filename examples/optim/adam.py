"""Adam (Kingma & Ba 2015) as ``torch.optim.Adam`` computes it, weight decay added to the gradient (L2).

The gradients are averaged over the ranks (``allreduce(g, op="avg")``), as DDP averages them: a loss computed
per rank needs no dividing by the world. ``examples/adam.py`` sums them instead, as the paper's step does.
"""

from coconet import Local, Program, Replicated, allreduce, sqrt

p = Program("adam_avg", dims=("N",))
g = p.tensor("g", ("N",), layout=Local)
w = p.tensor("w", ("N",), layout=Replicated)
m = p.tensor("m", ("N",), layout=Replicated)
v = p.tensor("v", ("N",), layout=Replicated)
lr, beta1, beta2, eps, weight_decay, t = p.scalars("lr beta1 beta2 eps weight_decay t")

grad = allreduce(g, op="avg") + weight_decay * w
m1 = beta1 * m + (1 - beta1) * grad
v1 = beta2 * v + (1 - beta2) * grad * grad
p.update(m, m1)
p.update(v, v1)
p.update(w, w - lr * (m1 / (1 - beta1**t)) / (sqrt(v1 / (1 - beta2**t)) + eps))

defaults = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}
program = p
