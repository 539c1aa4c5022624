"""Adafactor (Shazeer & Stern 2018) as ``torch.optim.Adafactor`` computes it for a vector: the unfactored
second moment, relative step size and update clipping. Gradients averaged over the ranks (``op="avg"``).

torch takes the root mean squares of the weights and of the update per parameter; here they span the flat
buffer the optimizer steps (one param group of one dtype), so a param group of one vector matches torch. The
step-dependent numbers (the decay ``1 - beta2_t``, the relative step ``rho``) and ``1 / sqrt(numel)`` come
from the host."""

from coconet import Local, Program, Replicated, allreduce, maximum, norm, rsqrt

p = Program("adafactor_vector", dims=("N",))
g = p.tensor("g", ("N",), layout=Local)
w = p.tensor("w", ("N",), layout=Replicated)
var = p.tensor("var", ("N",), layout=Replicated)
lr, weight_decay, eps1, eps2, d, decay, rho, inv_sqrt_n = p.scalars("lr weight_decay eps1 eps2 d decay rho inv_sqrt_n")

grad = allreduce(g, op="avg")
alpha = maximum(norm(w) * inv_sqrt_n, eps2) * rho
var1 = var + decay * (grad * grad - var)
update = rsqrt(maximum(var1, eps1 * eps1)) * grad
clip = maximum(norm(update) * inv_sqrt_n / d, 1.0)
p.update(var, var1)
p.update(w, w * (1 - lr * weight_decay) - (alpha / clip) * update)

defaults = {
    "lr": 1e-2,
    "beta2_decay": -0.8,
    "eps1": 1.1920928955078125e-07,
    "eps2": 1e-3,
    "d": 1.0,
    "weight_decay": 0.0,
}


def host_scalars(hyper, t, numel):
    return {
        "decay": float(t) ** hyper["beta2_decay"],
        "rho": min(hyper["lr"], 1 / t**0.5),
        "inv_sqrt_n": 1 / numel**0.5,
    }


program = p
