"""Adam entirely in bfloat16, as pure-bf16 training steps it without a float32 master copy: a bfloat16
gradient averaged in bfloat16 and bfloat16 weights and moments, every op of the update kept in bfloat16 (the
float32 hyper-parameters are 0-d and do not promote), each result rounded by torch's kernels. The fused
collective's chunk stays Inductor's, which rounds what it stores: C rounding every op as eager torch does
was measured slower (benchmarks/results/interleaved_adam_bf16_rounded_w{2,4}.json)."""

from coconet import Local, Program, Replicated, allreduce, sqrt

p = Program("adam_bf16", dims=("N",))
g = p.tensor("g", ("N",), layout=Local, dtype="bfloat16")
w = p.tensor("w", ("N",), layout=Replicated, dtype="bfloat16")
m = p.tensor("m", ("N",), layout=Replicated, dtype="bfloat16")
v = p.tensor("v", ("N",), layout=Replicated, dtype="bfloat16")
lr, beta1, beta2, eps, t = p.scalars("lr beta1 beta2 eps t")

avg = allreduce(g, op="avg")
m1 = beta1 * m + (1 - beta1) * avg
v1 = beta2 * v + (1 - beta2) * avg * avg
p.update(m, m1)
p.update(v, v1)
p.update(w, w - lr * (m1 / (1 - beta1**t)) / (sqrt(v1 / (1 - beta2**t)) + eps))
program = p
