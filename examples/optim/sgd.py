"""SGD with momentum, dampening, Nesterov and weight decay as ``torch.optim.SGD`` computes it. Gradients
averaged over the ranks (``op="avg"``).

torch starts the momentum buffer at the first step's gradient, undampened; the buffer here starts at zero,
so ``host_scalars`` passes no dampening on the first step (``damp``), which comes to the same. ``nesterov``
is a flag of the host (``nest`` in the program)."""

from coconet import Local, Program, Replicated, allreduce, where

p = Program("sgd_avg", dims=("N",))
g = p.tensor("g", ("N",), layout=Local)
w = p.tensor("w", ("N",), layout=Replicated)
buf = p.tensor("buf", ("N",), layout=Replicated)
lr, momentum, weight_decay, damp, nest = p.scalars("lr momentum weight_decay damp nest")

grad = allreduce(g, op="avg") + weight_decay * w
buf1 = momentum * buf + (1 - damp) * grad
p.update(buf, buf1)
p.update(w, w - lr * where(nest > 0.5, grad + momentum * buf1, buf1))

defaults = {"lr": 1e-2, "momentum": 0.0, "weight_decay": 0.0, "dampening": 0.0, "nesterov": False}


def host_scalars(hyper, t, numel):
    first = t == 1 or hyper["momentum"] == 0
    return {"damp": 0.0 if first else float(hyper["dampening"]), "nest": 1.0 if hyper["nesterov"] else 0.0}


program = p
