"""Adam on a float16 gradient averaged in float16, as DeepSpeed's fp16 engine reduces it by default
(``fp32_allreduce`` off) and as DDP reduces a half model's gradients: the sum over ranks rounded to float16 at
every rank added, then cast to float32, unscaled, and stepped with float32 master weights and moments; the
float16 copy of the weights written in the same step. On shm the fused collective's C chunk sums the peers'
float16 rows as torch adds them, each partial sum rounded."""

from coconet import Local, Program, Replicated, allreduce, cast, sqrt

p = Program("adam_fp16_grads", dims=("N",))
g = p.tensor("g", ("N",), layout=Local, dtype="float16")
w = p.tensor("w", ("N",), layout=Replicated)
m = p.tensor("m", ("N",), layout=Replicated)
v = p.tensor("v", ("N",), layout=Replicated)
w16 = p.tensor("w16", ("N",), layout=Replicated, dtype="float16")
lr, beta1, beta2, eps, t, inv_scale = p.scalars("lr beta1 beta2 eps t inv_scale")

avg = cast(allreduce(g, op="avg"), "float32") * inv_scale
m1 = beta1 * m + (1 - beta1) * avg
v1 = beta2 * v + (1 - beta2) * avg * avg
w1 = w - lr * (m1 / (1 - beta1**t)) / (sqrt(v1 / (1 - beta2**t)) + eps)
p.update(m, m1)
p.update(v, v1)
p.update(w, w1)
p.update(w16, cast(w1, "float16"))
program = p
