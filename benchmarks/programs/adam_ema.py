"""Adam with an exponential moving average of the weights (the averaged model evaluated or served, as
diffusion and large language model training keep it), and the new weights in bfloat16 returned for the
next forward pass rather than kept as state. On shm the fused collective's C chunk computes the step, the
average and the rounded copy in one pass, and writes the copy into this rank's slot of its gather."""

from coconet import Local, Program, Replicated, allreduce, cast, sqrt

p = Program("adam_ema", dims=("N",))
g = p.tensor("g", ("N",), layout=Local)
w = p.tensor("w", ("N",), layout=Replicated)
m = p.tensor("m", ("N",), layout=Replicated)
v = p.tensor("v", ("N",), layout=Replicated)
ema = p.tensor("ema", ("N",), layout=Replicated)
lr, beta1, beta2, eps, t, decay = p.scalars("lr beta1 beta2 eps t decay")

avg = allreduce(g, op="avg")
m1 = beta1 * m + (1 - beta1) * avg
v1 = beta2 * v + (1 - beta2) * avg * avg
w1 = w - lr * (m1 / (1 - beta1**t)) / (sqrt(v1 / (1 - beta2**t)) + eps)
p.update(m, m1)
p.update(v, v1)
p.update(w, w1)
p.update(ema, decay * ema + (1 - decay) * w1)
p.output("w16", cast(w1, "bfloat16"))
program = p
