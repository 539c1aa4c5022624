"""Error-feedback sign compression (1-bit SGD, EF-signSGD): each rank adds the residual it kept from the last
step to its gradient, sends the sign of the sum scaled by its mean magnitude, keeps what the compression lost
as the next residual (a state of each rank's own), and momentum SGD steps on the average of the compressed
gradients. The mask of signs is made before the reduction the scale needs and read after it; the compressed
gradient is computed by a kernel into the buffer the fused collective reads it from, and the residual is
written in place by the same kernel."""

from coconet import Local, Program, Replicated, abs, allreduce, sum, where

p = Program("ef_sign", dims=("N",))
g = p.tensor("g", ("N",), layout=Local)
e = p.tensor("e", ("N",), layout=Local)
w = p.tensor("w", ("N",), layout=Replicated)
mom = p.tensor("mom", ("N",), layout=Replicated)
lr, inv_n = p.scalars("lr inv_n")
c = g + e
scale = sum(abs(c)) * inv_n
q = where(c >= 0.0, scale, -scale)
p.update(e, c - q)
avg = allreduce(q, op="avg")
m1 = 0.9 * mom + avg
p.update(mom, m1)
p.update(w, w - lr * m1)
program = p
