"""RAdam (Liu et al. 2020) as ``torch.optim.RAdam`` computes it. Gradients averaged over the ranks
(``op="avg"``).

The variance rectification is a number of the step alone: ``host_scalars`` computes it each step and whether
it applies (``rectified``: the approximated SMA's length rho_t above 5, from about the sixth step with
beta2 = 0.999); before, the step is the bias-corrected momentum alone."""

import math

from coconet import Local, Program, Replicated, allreduce, sqrt, where

p = Program("radam", dims=("N",))
g = p.tensor("g", ("N",), layout=Local)
w = p.tensor("w", ("N",), layout=Replicated)
m = p.tensor("m", ("N",), layout=Replicated)
v = p.tensor("v", ("N",), layout=Replicated)
lr, beta1, beta2, eps, weight_decay, t, rect, rectified = p.scalars("lr beta1 beta2 eps weight_decay t rect rectified")

grad = allreduce(g, op="avg") + weight_decay * w
m1 = beta1 * m + (1 - beta1) * grad
v1 = beta2 * v + (1 - beta2) * grad * grad
m_hat = m1 / (1 - beta1**t)
adaptive = sqrt(1 - beta2**t) / (sqrt(v1) + eps)
p.update(m, m1)
p.update(v, v1)
p.update(w, w - lr * where(rectified > 0.5, m_hat * adaptive * rect, m_hat))

defaults = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}


def host_scalars(hyper, t, numel):
    beta2 = hyper["beta2"]
    rho_inf = 2 / (1 - beta2) - 1
    rho_t = rho_inf - 2 * t * beta2**t / (1 - beta2**t)
    if rho_t <= 5.0:
        return {"rect": 0.0, "rectified": 0.0}
    rect = math.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t))
    return {"rect": rect, "rectified": 1.0}


program = p
