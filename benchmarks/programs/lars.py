"""LARS (You et al. 2017) after the gradient's averaging allreduce: SGD with momentum whose step is scaled by the
layer's trust ratio ``eta * ||w|| / (||g|| + wd * ||w||)``, weight decay in the direction. Two norms, one of
the replicated weights, one of the reduced gradient."""

from coconet import Local, Program, Replicated, allreduce, norm

p = Program("lars", dims=("N",))
g = p.tensor("g", ("N",), layout=Local)
w = p.tensor("w", ("N",), layout=Replicated)
v = p.tensor("v", ("N",), layout=Replicated)
lr, momentum, wd, eta, eps = p.scalars("lr momentum wd eta eps")
grad = allreduce(g, op="avg")
w_norm = norm(w)
trust = eta * w_norm / (norm(grad) + wd * w_norm + eps)
v1 = momentum * v + lr * trust * (grad + wd * w)
p.update(v, v1)
p.update(w, w - v1)
program = p
