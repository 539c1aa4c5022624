"""Adam with its moments kept in bfloat16, as Megatron-LM's precision-aware optimizer keeps them
(--exp-avg-dtype and --exp-avg-sq-dtype bf16) and torchdistx's AnyPrecisionAdamW does: half the optimizer
state's bytes. Each moment is widened to float32, updated in float32 and stored back rounded to bfloat16; the
weights stay float32. On shm the fused collective's C chunk loads the moments' bfloat16 rows, widening them as
it reads, and streams their new rows into the peers' copies beside the float32 weights."""

from coconet import Local, Program, Replicated, allreduce, cast, sqrt

p = Program("adam_bf16_states", dims=("N",))
g = p.tensor("g", ("N",), layout=Local)
w = p.tensor("w", ("N",), layout=Replicated)
m = p.tensor("m", ("N",), layout=Replicated, dtype="bfloat16")
v = p.tensor("v", ("N",), layout=Replicated, dtype="bfloat16")
lr, beta1, beta2, eps, t = p.scalars("lr beta1 beta2 eps t")

avg = allreduce(g, op="avg")
m1 = beta1 * cast(m, "float32") + (1 - beta1) * avg
v1 = beta2 * cast(v, "float32") + (1 - beta2) * avg * avg
p.update(m, cast(m1, "bfloat16"))
p.update(v, cast(v1, "bfloat16"))
p.update(w, w - lr * (m1 / (1 - beta1**t)) / (sqrt(v1 / (1 - beta2**t)) + eps))
program = p
