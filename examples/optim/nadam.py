"""NAdam (Dozat 2016) as ``torch.optim.NAdam`` computes it, momentum decay included. Gradients averaged over
the ranks (``op="avg"``).

The momentum schedule's running product is a number of the step alone, so it is computed on the host each
step (``host_scalars``) and enters the program as the two step sizes ``c_grad`` and ``c_avg``."""

import numpy as np

from coconet import Local, Program, Replicated, allreduce, sqrt

p = Program("nadam", dims=("N",))
g = p.tensor("g", ("N",), layout=Local)
w = p.tensor("w", ("N",), layout=Replicated)
m = p.tensor("m", ("N",), layout=Replicated)
v = p.tensor("v", ("N",), layout=Replicated)
beta1, beta2, eps, weight_decay, t, c_grad, c_avg = p.scalars("beta1 beta2 eps weight_decay t c_grad c_avg")

grad = allreduce(g, op="avg") + weight_decay * w
m1 = beta1 * m + (1 - beta1) * grad
v1 = beta2 * v + (1 - beta2) * grad * grad
denom = sqrt(v1 / (1 - beta2**t)) + eps
p.update(m, m1)
p.update(v, v1)
p.update(w, w - c_grad * grad / denom - c_avg * m1 / denom)

defaults = {"lr": 2e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0, "momentum_decay": 4e-3}


def host_scalars(hyper, t, numel):
    """mu_t and its running product over steps 1..t, multiplied in float32 as torch keeps it."""
    beta1, decay, lr = hyper["beta1"], hyper["momentum_decay"], hyper["lr"]
    mus = beta1 * (1.0 - 0.5 * 0.96 ** (np.arange(1, t + 2, dtype=np.float64) * decay))
    product = np.cumprod(mus[:t].astype(np.float32))[-1]
    mu, mu_next = float(mus[t - 1]), float(mus[t])
    return {
        "c_grad": lr * (1.0 - mu) / (1.0 - float(product)),
        "c_avg": lr * mu_next / (1.0 - float(product) * mu_next),
    }


program = p
