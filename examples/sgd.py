"""Data-parallel SGD with momentum and weight decay, as torch.optim.SGD computes it
(dampening 0), after the allreduce of the gradients (CoCoNet §6.1).
"""

from coconet import Local, Program, Replicated, allreduce

p = Program("sgd", dims=("N",))
g = p.tensor("g", ("N",), layout=Local)
w = p.tensor("w", ("N",), layout=Replicated)
buf = p.tensor("buf", ("N",), layout=Replicated)
lr, momentum, weight_decay = p.scalars("lr momentum weight_decay")

d = allreduce(g) + weight_decay * w
buf1 = momentum * buf + d
p.update(buf, buf1)
p.update(w, w - lr * buf1)
program = p
