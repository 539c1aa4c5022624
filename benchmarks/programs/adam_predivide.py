"""Adam on a gradient divided before its allreduce and multiplied back after, as apex's and DeepSpeed's
``gradient_predivide_factor`` step it (the sum of float16 gradients over many ranks stays in range): a
computation on each rank's gradient before the reduction, which the fused collective's kernel takes in."""

from coconet import Local, Program, Replicated, allreduce, sqrt

p = Program("adam_predivide", dims=("N",))
g = p.tensor("g", ("N",), layout=Local)
w = p.tensor("w", ("N",), layout=Replicated)
m = p.tensor("m", ("N",), layout=Replicated)
v = p.tensor("v", ("N",), layout=Replicated)
lr, beta1, beta2, eps, predivide, world = p.scalars("lr beta1 beta2 eps predivide world")
grad = allreduce(g / predivide) * (predivide / world)
m1 = beta1 * m + (1 - beta1) * grad
v1 = beta2 * v + (1 - beta2) * grad * grad
p.update(m, m1)
p.update(v, v1)
p.update(w, w - lr * m1 / (sqrt(v1) + eps))
program = p
