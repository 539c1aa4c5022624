"""Adam with a softplus of sqrt(v) in place of sqrt(v) + eps (Tong et al. 2019, "Calibrating the adaptive
learning rate"): the update's exp and log run on every element."""

from coconet import Local, Program, Replicated, allreduce, exp, log, sqrt

p = Program("sadam", dims=("N",))
g = p.tensor("g", ("N",), layout=Local)
w = p.tensor("w", ("N",), layout=Replicated)
m = p.tensor("m", ("N",), layout=Replicated)
v = p.tensor("v", ("N",), layout=Replicated)
lr, beta1, beta2, smooth, t = p.scalars("lr beta1 beta2 smooth t")

avg = allreduce(g)
m1 = beta1 * m + (1 - beta1) * avg
v1 = beta2 * v + (1 - beta2) * avg**2
m_hat = m1 / (1 - beta1**t)
v_hat = v1 / (1 - beta2**t)
p.update(m, m1)
p.update(v, v1)
p.update(w, w - lr * m_hat / (log(1 + exp(smooth * sqrt(v_hat))) / smooth))
program = p
