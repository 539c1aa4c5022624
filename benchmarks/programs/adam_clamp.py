"""Adam on a gradient clamped to [-clip, clip] element by element, its bias corrections written as
exp(t * log(beta)): the DSL's maximum, minimum, exp and log in an optimizer step."""

from coconet import Local, Program, Replicated, allreduce, exp, log, maximum, minimum, sqrt

p = Program("adam_clamp", dims=("N",))
g = p.tensor("g", ("N",), layout=Local)
w = p.tensor("w", ("N",), layout=Replicated)
m = p.tensor("m", ("N",), layout=Replicated)
v = p.tensor("v", ("N",), layout=Replicated)
lr, beta1, beta2, eps, t, clip = p.scalars("lr beta1 beta2 eps t clip")
grad = minimum(maximum(allreduce(g), -clip), clip)
m1 = beta1 * m + (1 - beta1) * grad
v1 = beta2 * v + (1 - beta2) * grad * grad
bc1 = 1 - exp(t * log(beta1))
bc2 = 1 - exp(t * log(beta2))
p.update(m, m1)
p.update(v, v1)
p.update(w, w - lr * (m1 / bc1) / (sqrt(v1 / bc2) + eps))
program = p
