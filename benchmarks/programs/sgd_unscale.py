"""SGD with Nesterov momentum on a loss-scaled gradient, as mixed-precision training steps it: the reduced
gradient divided by the loss scale, and the count of its elements that are not finite (``GradScaler``'s
found_inf, an inf or a NaN: neither is at most the largest float32) returned beside the update."""

from coconet import Local, Program, Replicated, abs, allreduce, sum, where

p = Program("sgd_unscale", dims=("N",))
g = p.tensor("g", ("N",), layout=Local)
w = p.tensor("w", ("N",), layout=Replicated)
buf = p.tensor("buf", ("N",), layout=Replicated)
lr, momentum, scale = p.scalars("lr momentum scale")

grad = allreduce(g) / scale
nonfinite = sum(where(abs(grad) <= 3.4028234663852886e38, 0.0, 1.0))
b1 = momentum * buf + grad
p.update(buf, b1)
p.update(w, w - lr * (grad + momentum * b1))
p.output("nonfinite", nonfinite)
program = p
