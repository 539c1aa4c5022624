"""AdamW after the gradient's allreduce and clipping to a global norm: ``clip_grad_norm_`` then
``torch.optim.AdamW``'s update. The norm needs the whole reduced gradient before any weight moves."""

from coconet import Local, Program, Replicated, allreduce, minimum, norm, sqrt

p = Program("adamw_clip", dims=("N",))
g = p.tensor("g", ("N",), layout=Local)
w = p.tensor("w", ("N",), layout=Replicated)
m = p.tensor("m", ("N",), layout=Replicated)
v = p.tensor("v", ("N",), layout=Replicated)
lr, beta1, beta2, eps, weight_decay, t, max_norm = p.scalars("lr beta1 beta2 eps weight_decay t max_norm")

grad = allreduce(g)
clipped = grad * minimum(max_norm / (norm(grad) + 1e-6), 1.0)  # clip_grad_norm_'s coefficient, at most 1
m1 = beta1 * m + (1 - beta1) * clipped
v1 = beta2 * v + (1 - beta2) * clipped * clipped
p.update(m, m1)
p.update(v, v1)
p.update(w, w * (1 - lr * weight_decay) - lr * (m1 / (1 - beta1**t)) / (sqrt(v1 / (1 - beta2**t)) + eps))
program = p
