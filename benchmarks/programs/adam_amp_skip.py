"""Adam behind a dynamic loss scaler, as torch.amp.GradScaler steps it: the gradient unscaled, each rank
counts its non-finite elements, a max allreduce of the counts, and the step skipped (every state left as it
was) where any rank overflowed. The count is a sum over a mask computed from the gradient: a fuse group
computes both, and the mask is never written out."""

from coconet import Local, Program, Replicated, abs, allreduce, sqrt, sum, where

p = Program("adam_amp_skip", dims=("N",))
g = p.tensor("g", ("N",), layout=Local)
w = p.tensor("w", ("N",), layout=Replicated)
m = p.tensor("m", ("N",), layout=Replicated)
v = p.tensor("v", ("N",), layout=Replicated)
lr, inv_scale, t = p.scalars("lr inv_scale t")
overflowed = sum(where(abs(g) > 1e30, 1.0, 0.0))
found = allreduce(overflowed, op="max")
grad = allreduce(g) * inv_scale
m1 = 0.9 * m + 0.1 * grad
v1 = 0.999 * v + 0.001 * grad * grad
step = lr * (m1 / (1 - 0.9**t)) / (sqrt(v1 / (1 - 0.999**t)) + 1e-8)
ok = found < 0.5
p.update(m, where(ok, m1, m))
p.update(v, where(ok, v1, v))
p.update(w, where(ok, w - step, w))
p.output("found", found)
program = p
