"""Adafactor's step for a matrix (Shazeer & Stern, 2018), without update clipping: the second moment of the
averaged gradient kept as an (M, 1) row factor and a (1, K) column factor, each a running mean of g^2's row or
column sums, written as products with ones (the DSL's reductions are over all elements); the update divides
g by the root of their outer product over its mean. Each rank computes the outer product on its own rows of
the update alone, the factors cut or whole as they broadcast."""

from coconet import Local, Program, Replicated, allreduce, matmul, rsqrt, sum

p = Program("adafactor", dims=("M", "K"))
g = p.tensor("g", ("M", "K"), layout=Local)
w = p.tensor("w", ("M", "K"), layout=Replicated)
r = p.tensor("r", ("M", 1), layout=Replicated)
c = p.tensor("c", (1, "K"), layout=Replicated)
ones_k = p.tensor("ones_k", ("K", 1), layout=Replicated)
ones_m = p.tensor("ones_m", (1, "M"), layout=Replicated)
lr, b2, inv_k, inv_m, eps = p.scalars("lr b2 inv_k inv_m eps")
gg = allreduce(g, op="avg")
sq = gg * gg + eps
r1 = b2 * r + (1 - b2) * matmul(sq, ones_k) * inv_k
c1 = b2 * c + (1 - b2) * matmul(ones_m, sq) * inv_m
vhat = r1 * c1 / (sum(r1) * inv_m)
p.update(r, r1)
p.update(c, c1)
p.update(w, w - lr * gg * rsqrt(vhat))
program = p
