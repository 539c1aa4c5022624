"""Adam after gradient accumulation: the last micro-batch's gradient is added to the sum of the earlier ones,
which the step keeps in a buffer of each rank's own and clears, and the total is averaged over the ranks in
one allreduce (DDP's ``no_sync`` for all but the last micro-batch). The fused collective's chunk kernel reads
every rank's rows of acc and g where they lie and sums them as it reduces them: acc + g is never written out."""

from coconet import Local, Program, Replicated, allreduce, sqrt

p = Program("adam_accumulate", dims=("N",))
g = p.tensor("g", ("N",), layout=Local)
acc = p.tensor("acc", ("N",), layout=Local)
w = p.tensor("w", ("N",), layout=Replicated)
m = p.tensor("m", ("N",), layout=Replicated)
v = p.tensor("v", ("N",), layout=Replicated)
lr, beta1, beta2, eps, micro = p.scalars("lr beta1 beta2 eps micro")
grad = allreduce(acc + g, op="avg") / micro
m1 = beta1 * m + (1 - beta1) * grad
v1 = beta2 * v + (1 - beta2) * grad * grad
p.update(m, m1)
p.update(v, v1)
p.update(acc, acc * 0.0)
p.update(w, w - lr * m1 / (sqrt(v1) + eps))
program = p
