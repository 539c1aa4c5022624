"""Delayed scaling as FP8 training keeps it: the elementwise maximum over ranks of |g| (an amax), a 0-d scale
state moved toward 448 over its mean, and the averaged gradient scaled and returned in float16, with the
scale it was scaled by. The amax's chunk kernel takes |g| of every rank's rows as it reads them where they lie
and keeps their maximum and its sum: |g| is never written out."""

from coconet import Local, Program, Replicated, abs, allreduce, cast, maximum, sum

p = Program("amax_scale", dims=("N",))
g = p.tensor("g", ("N",), layout=Local)
s = p.tensor("s", (), layout=Replicated)
inv_n = p.scalar("inv_n")
amax = allreduce(abs(g), op="max")
target = 448.0 / maximum(sum(amax) * inv_n, 1e-12)
p.output("old_scale", s)
p.output("q", cast(allreduce(g, op="avg") * s, "float16"))
p.update(s, 0.9 * s + 0.1 * target)
program = p
