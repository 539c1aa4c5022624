"""Centered RMSprop (Graves 2013) as ``torch.optim.RMSprop(centered=True)`` computes it, with momentum and weight
decay: the running mean of squares less the square of the running mean of gradients estimates their variance.
Gradients averaged over the ranks (``op="avg"``). The plain form is ``rmsprop.py``."""

from coconet import Local, Program, Replicated, allreduce, sqrt

p = Program("rmsprop_centered_avg", dims=("N",))
g = p.tensor("g", ("N",), layout=Local)
w = p.tensor("w", ("N",), layout=Replicated)
sq = p.tensor("sq", ("N",), layout=Replicated)
gavg = p.tensor("gavg", ("N",), layout=Replicated)
buf = p.tensor("buf", ("N",), layout=Replicated)
lr, alpha, eps, momentum, weight_decay = p.scalars("lr alpha eps momentum weight_decay")

grad = allreduce(g, op="avg") + weight_decay * w
sq1 = alpha * sq + (1 - alpha) * grad * grad
gavg1 = alpha * gavg + (1 - alpha) * grad
buf1 = momentum * buf + grad / (sqrt(sq1 - gavg1 * gavg1) + eps)
p.update(sq, sq1)
p.update(gavg, gavg1)
p.update(buf, buf1)
p.update(w, w - lr * buf1)

defaults = {"lr": 1e-2, "alpha": 0.99, "eps": 1e-8, "momentum": 0.0, "weight_decay": 0.0}
program = p
