"""Adam on a gradient averaged over the tokens of every rank rather than over the ranks: each rank's gradient
is the mean over its own tokens, whose count differs from rank to rank (packed sequences, dropped padding), so
each is weighted by its count before the sum and the sum divided by the total. The count is a number each
rank holds its own of, which every rank posts at the barrier that begins the fused collective, and its
kernel weights each rank's rows as it sums them."""

from coconet import Local, Program, Replicated, allreduce, sqrt

p = Program("adam_token_weighted", dims=("N",))
g = p.tensor("g", ("N",), layout=Local)
tokens = p.tensor("tokens", (), layout=Local)
w = p.tensor("w", ("N",), layout=Replicated)
m = p.tensor("m", ("N",), layout=Replicated)
v = p.tensor("v", ("N",), layout=Replicated)
lr, beta1, beta2, eps = p.scalars("lr beta1 beta2 eps")
grad = allreduce(g * tokens) / allreduce(tokens)
m1 = beta1 * m + (1 - beta1) * grad
v1 = beta2 * v + (1 - beta2) * grad * grad
p.update(m, m1)
p.update(v, v1)
p.update(w, w - lr * m1 / (sqrt(v1) + eps))
program = p
