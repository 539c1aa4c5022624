"""Adagrad after the gradient's allreduce: torch.optim.Adagrad's update (no decay)."""

from coconet import Local, Program, Replicated, allreduce, sqrt

p = Program("adagrad", dims=("N",))
g = p.tensor("g", ("N",), layout=Local)
w = p.tensor("w", ("N",), layout=Replicated)
s = p.tensor("s", ("N",), layout=Replicated)
lr, eps = p.scalars("lr eps")

avg = allreduce(g)
s1 = s + avg * avg
p.update(s, s1)
p.update(w, w - lr * avg / (sqrt(s1) + eps))
program = p
