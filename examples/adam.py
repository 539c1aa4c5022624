"""Data-parallel Adam step with its gradient allreduce (Kingma & Ba 2015; CoCoNet §6.1).

Each rank holds its own gradient ``g`` (Local); weights and moments are
replicated. CoCoNet's schedules split the allreduce, run the update on slices
and fuse it into the collective.
"""

from coconet import Local, Program, Replicated, allreduce, sqrt

p = Program("adam", dims=("N",))
g = p.tensor("g", ("N",), layout=Local)
w = p.tensor("w", ("N",), layout=Replicated)
m = p.tensor("m", ("N",), layout=Replicated)
v = p.tensor("v", ("N",), layout=Replicated)
lr, beta1, beta2, eps, t = p.scalars("lr beta1 beta2 eps t")

avg = allreduce(g)
m1 = beta1 * m + (1 - beta1) * avg
v1 = beta2 * v + (1 - beta2) * avg * avg
m_hat = m1 / (1 - beta1**t)
v_hat = v1 / (1 - beta2**t)
p.update(m, m1)
p.update(v, v1)
p.update(w, w - lr * m_hat / (sqrt(v_hat) + eps))
program = p
