"""Adam with AMSGrad's running maximum after the gradient's allreduce: torch.optim.Adam(amsgrad=True)'s update."""

from coconet import Local, Program, Replicated, allreduce, maximum, sqrt

p = Program("amsgrad", dims=("N",))
g = p.tensor("g", ("N",), layout=Local)
w = p.tensor("w", ("N",), layout=Replicated)
m = p.tensor("m", ("N",), layout=Replicated)
v = p.tensor("v", ("N",), layout=Replicated)
vmax = p.tensor("vmax", ("N",), layout=Replicated)
lr, beta1, beta2, eps, t = p.scalars("lr beta1 beta2 eps t")

avg = allreduce(g)
m1 = beta1 * m + (1 - beta1) * avg
v1 = beta2 * v + (1 - beta2) * avg * avg
vmax1 = maximum(vmax, v1)
p.update(m, m1)
p.update(v, v1)
p.update(vmax, vmax1)
p.update(w, w - lr / (1 - beta1**t) * m1 / (sqrt(vmax1) / sqrt(1 - beta2**t) + eps))
program = p
