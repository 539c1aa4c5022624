"""Data-parallel Adam over the parameters of a transformer MLP block:
several tensors of different sizes and ranks (CoCoNet §3, interface
optimisation). Frameworks flatten such tensors into one buffer before the
allreduce; bucketing runs one collective over the buffers without that copy.
"""

from coconet import Local, Program, Replicated, allreduce, sqrt

p = Program("adam_multi", dims=("H",))
lr, beta1, beta2, eps, t = p.scalars("lr beta1 beta2 eps t")

for name, shape in (("w1", ("H", "4*H")), ("b1", ("4*H",)), ("w2", ("4*H", "H")), ("b2", ("H",))):
    g = p.tensor(f"{name}_grad", shape, layout=Local)
    w = p.tensor(name, shape, layout=Replicated)
    m = p.tensor(f"{name}_m", shape, layout=Replicated)
    v = p.tensor(f"{name}_v", shape, layout=Replicated)
    avg = allreduce(g)
    m1 = beta1 * m + (1 - beta1) * avg
    v1 = beta2 * v + (1 - beta2) * avg * avg
    p.update(m, m1)
    p.update(v, v1)
    p.update(w, w - lr * (m1 / (1 - beta1**t)) / (sqrt(v1 / (1 - beta2**t)) + eps))
program = p
