"""Adam in mixed precision as Megatron-LM's and DeepSpeed's bf16 optimizers step it: a bfloat16 gradient
averaged in float32, float32 master weights and moments, and the bfloat16 copy of the weights that the next
forward pass reads, written from the new master weights in the same step. On shm the fused collective's C
chunk rounds the copy as torch does and streams it into the peers' copies beside the float32 state."""

from coconet import Local, Program, Replicated, allreduce, cast, sqrt

p = Program("adam_bf16_params", dims=("N",))
g = p.tensor("g", ("N",), layout=Local, dtype="bfloat16")
w = p.tensor("w", ("N",), layout=Replicated)
m = p.tensor("m", ("N",), layout=Replicated)
v = p.tensor("v", ("N",), layout=Replicated)
w16 = p.tensor("w16", ("N",), layout=Replicated, dtype="bfloat16")
lr, beta1, beta2, eps, t = p.scalars("lr beta1 beta2 eps t")

avg = allreduce(cast(g, "float32"), op="avg")
m1 = beta1 * m + (1 - beta1) * avg
v1 = beta2 * v + (1 - beta2) * avg * avg
w1 = w - lr * (m1 / (1 - beta1**t)) / (sqrt(v1 / (1 - beta2**t)) + eps)
p.update(m, m1)
p.update(v, v1)
p.update(w, w1)
p.update(w16, cast(w1, "bfloat16"))
program = p
