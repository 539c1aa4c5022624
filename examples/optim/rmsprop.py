"""RMSprop (Hinton 2012) as ``torch.optim.RMSprop`` computes it, not centered, with momentum and weight decay
(momentum 0 is plain RMSprop: the buffer is then the step itself). Gradients averaged over the ranks
(``op="avg"``)."""

from coconet import Local, Program, Replicated, allreduce, sqrt

p = Program("rmsprop_avg", dims=("N",))
g = p.tensor("g", ("N",), layout=Local)
w = p.tensor("w", ("N",), layout=Replicated)
sq = p.tensor("sq", ("N",), layout=Replicated)
buf = p.tensor("buf", ("N",), layout=Replicated)
lr, alpha, eps, momentum, weight_decay = p.scalars("lr alpha eps momentum weight_decay")

grad = allreduce(g, op="avg") + weight_decay * w
sq1 = alpha * sq + (1 - alpha) * grad * grad
buf1 = momentum * buf + grad / (sqrt(sq1) + eps)
p.update(sq, sq1)
p.update(buf, buf1)
p.update(w, w - lr * buf1)

defaults = {"lr": 1e-2, "alpha": 0.99, "eps": 1e-8, "momentum": 0.0, "weight_decay": 0.0}
program = p
