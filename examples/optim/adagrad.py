"""Adagrad (Duchi et al. 2011) as ``torch.optim.Adagrad`` computes it, learning-rate decay, weight decay and
``initial_accumulator_value`` (where the sum of squares starts) included. Gradients averaged over the ranks
(``op="avg"``)."""

from coconet import Local, Program, Replicated, allreduce, sqrt

p = Program("adagrad_avg", dims=("N",))
g = p.tensor("g", ("N",), layout=Local)
w = p.tensor("w", ("N",), layout=Replicated)
s = p.tensor("s", ("N",), layout=Replicated)
lr, lr_decay, eps, weight_decay, t = p.scalars("lr lr_decay eps weight_decay t")

grad = allreduce(g, op="avg") + weight_decay * w
s1 = s + grad * grad
p.update(s, s1)
p.update(w, w - (lr / (1 + (t - 1) * lr_decay)) * grad / (sqrt(s1) + eps))

defaults = {"lr": 1e-2, "lr_decay": 0.0, "eps": 1e-10, "weight_decay": 0.0, "initial_accumulator_value": 0.0}
initial_state = {"s": "initial_accumulator_value"}  # coconet.optim fills s with it when it makes the buffer
program = p
