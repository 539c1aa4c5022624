"""RMSprop with momentum and weight decay after the gradient's allreduce: torch.optim.RMSprop's update."""

from coconet import Local, Program, Replicated, allreduce, sqrt

p = Program("rmsprop", dims=("N",))
g = p.tensor("g", ("N",), layout=Local)
w = p.tensor("w", ("N",), layout=Replicated)
sq = p.tensor("sq", ("N",), layout=Replicated)
buf = p.tensor("buf", ("N",), layout=Replicated)
lr, alpha, eps, momentum, weight_decay = p.scalars("lr alpha eps momentum weight_decay")

d = allreduce(g) + weight_decay * w
sq1 = alpha * sq + (1 - alpha) * d * d
buf1 = momentum * buf + d / (sqrt(sq1) + eps)
p.update(sq, sq1)
p.update(buf, buf1)
p.update(w, w - lr * buf1)
program = p
