"""Momentum SGD in mixed precision: a bfloat16 gradient cast to float32 and unscaled by the loss scale before
its allreduce (averaged), fp32 master weights and momentum. The cast and the unscale run on each rank's
gradient before the reduction: the fused collective's kernel takes them in."""

from coconet import Local, Program, Replicated, allreduce, cast

p = Program("momentum_bf16", dims=("N",))
g = p.tensor("g", ("N",), layout=Local, dtype="bfloat16")
w = p.tensor("w", ("N",), layout=Replicated)
buf = p.tensor("buf", ("N",), layout=Replicated)
lr, momentum, inv_scale = p.scalars("lr momentum inv_scale")
grad = allreduce(cast(g, "float32") * inv_scale, op="avg")
b1 = momentum * buf + grad
p.update(buf, b1)
p.update(w, w - lr * b1)
program = p
