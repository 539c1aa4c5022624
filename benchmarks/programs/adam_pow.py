"""Adam as it is often written: the second moment from ``avg ** 2`` and the step over ``v_hat ** 0.5``."""

from coconet import Local, Program, Replicated, allreduce

p = Program("adam_pow", dims=("N",))
g = p.tensor("g", ("N",), layout=Local)
w = p.tensor("w", ("N",), layout=Replicated)
m = p.tensor("m", ("N",), layout=Replicated)
v = p.tensor("v", ("N",), layout=Replicated)
lr, beta1, beta2, eps, t = p.scalars("lr beta1 beta2 eps t")

avg = allreduce(g)
m1 = beta1 * m + (1 - beta1) * avg
v1 = beta2 * v + (1 - beta2) * avg**2
m_hat = m1 / (1 - beta1**t)
v_hat = v1 / (1 - beta2**t)
p.update(m, m1)
p.update(v, v1)
p.update(w, w - lr * m_hat / (v_hat**0.5 + eps))
program = p
