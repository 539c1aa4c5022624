"""Data-parallel LAMB step (You et al., ICLR 2020; CoCoNet §6.1).

The per-tensor trust ratio ``norm(w) / norm(u)`` is why LAMB is the hard case:
once the update runs on slices, each norm becomes a partial norm per rank plus
an allreduce, which the IR makes explicit.
"""

from coconet import Local, Program, Replicated, allreduce, norm, sqrt

p = Program("lamb", dims=("N",))
g = p.tensor("g", ("N",), layout=Local)
w = p.tensor("w", ("N",), layout=Replicated)
m = p.tensor("m", ("N",), layout=Replicated)
v = p.tensor("v", ("N",), layout=Replicated)
lr, beta1, beta2, eps, weight_decay, t = p.scalars("lr beta1 beta2 eps weight_decay t")

avg = allreduce(g)
m1 = beta1 * m + (1 - beta1) * avg
v1 = beta2 * v + (1 - beta2) * avg * avg
m_hat = m1 / (1 - beta1**t)
v_hat = v1 / (1 - beta2**t)
u = m_hat / (sqrt(v_hat) + eps) + weight_decay * w
trust = norm(w) / norm(u)
p.update(m, m1)
p.update(v, v1)
p.update(w, w - lr * trust * u)
program = p
