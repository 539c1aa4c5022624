"""Adam in float16 mixed precision as apex's O2 and DeepSpeed's fp16 optimizer step it: a float16 gradient of a
scaled loss, cast to float32 before it is averaged and unscaled there, float32 master weights and moments, and
the float16 copy of the weights that the next forward pass reads, written from the new master weights in the
same step. On shm the fused collective's C chunk widens the gradient and rounds the copy as torch does (F16C)
and streams the copy into the peers' copies beside the float32 state."""

from coconet import Local, Program, Replicated, allreduce, cast, sqrt

p = Program("adam_fp16_params", dims=("N",))
g = p.tensor("g", ("N",), layout=Local, dtype="float16")
w = p.tensor("w", ("N",), layout=Replicated)
m = p.tensor("m", ("N",), layout=Replicated)
v = p.tensor("v", ("N",), layout=Replicated)
w16 = p.tensor("w16", ("N",), layout=Replicated, dtype="float16")
lr, beta1, beta2, eps, t, inv_scale = p.scalars("lr beta1 beta2 eps t inv_scale")

avg = allreduce(cast(g, "float32"), op="avg") * inv_scale
m1 = beta1 * m + (1 - beta1) * avg
v1 = beta2 * v + (1 - beta2) * avg * avg
w1 = w - lr * (m1 / (1 - beta1**t)) / (sqrt(v1 / (1 - beta2**t)) + eps)
p.update(m, m1)
p.update(v, v1)
p.update(w, w1)
p.update(w16, cast(w1, "float16"))
program = p
