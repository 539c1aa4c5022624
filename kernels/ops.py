"""The ops a generated step calls that are not torch's own as they stand: the matrix product, the
convolution, the L2 norm, a host integer as a kernel argument, a dim's size that the inputs do not show.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


def matmul(a, b):
    """a (..., K) @ b (K, M), or a batch of products (torch.matmul's, as it stands). float32 on CPU by a matrix
    goes through oneDNN's linear, as Inductor's CPU lowering does:
    on the Megatron layer's shapes it ran 1.07-1.25x torch.matmul's MKL sgemm where first measured, two
    ranks at once included, and 0.85-0.99x on an Intel Xeon (benchmarks/cpu_matmul.py). A product with
    one row or one column (a matrix's row or column sums as a product with ones) is torch.matmul: MKL's
    gemv ran it 1.9-2.4x as fast as oneDNN there. Anything else, or a torch without oneDNN, too."""
    if (
        a.device.type == "cpu"
        and a.dtype == b.dtype == torch.float32
        and a.dim() >= 2
        and b.dim() == 2
        and a.numel()
        and b.numel()
        and a.numel() > a.shape[-1]
        and b.shape[-1] > 1
        and torch.backends.mkldnn.is_available()
    ):
        if not (b.is_contiguous() or b.t().is_contiguous()):
            # a weight whose rows are strided (the overlap's column chunks of a weight): oneDNN's linear on
            # one took 15 s where the same chunk copied took 11 ms (2048 x 1024 x 256); the copy is 1/m of
            # the product's work
            b = b.contiguous()
        y = torch.ops.mkldnn._linear_pointwise(a.reshape(-1, a.shape[-1]), b.t(), None, "none", [], "")
        return y.reshape(a.shape[:-1] + b.shape[-1:])
    return torch.matmul(a, b)


def conv(x, w, stride, padding, dilation, groups):
    """``F.conv1d``/``F.conv2d`` (by w's dims), no bias. A rank's uneven slice of the channels may hold none:
    torch refuses a weight without output channels and gives no channels at all for an input without any,
    where the result is zeros of the full shape (what those channels add to a partial sum). On CUDA a float32
    convolution runs in float32, not cuDNN's default TF32 (10-bit mantissas), as the generated code's matmuls
    do: the schedules are checked against the float64 reference at float32's tolerance."""
    if not (w.shape[0] and w.shape[1]):
        spatial = [
            (n + 2 * p - d * (k - 1) - 1) // s + 1
            for n, k, s, p, d in zip(x.shape[2:], w.shape[2:], stride, padding, dilation)
        ]
        return x.new_zeros((x.shape[0], w.shape[0], *spatial))
    fn = F.conv1d if w.dim() == 3 else F.conv2d
    with ieee_float32(x):
        return fn(x, w, None, stride, padding, dilation, groups)


@contextlib.contextmanager
def ieee_float32(x):
    """Convolutions of ``x`` inside run in float32 where it is a float32 CUDA tensor: cuDNN's TF32 off, and back
    on after."""
    cudnn = torch.backends.cudnn
    if not (x.is_cuda and x.dtype == torch.float32 and cudnn.allow_tf32):
        yield
        return
    cudnn.allow_tf32 = False
    try:
        yield
    finally:
        cudnn.allow_tf32 = True


def norm(x, block=4096):
    """The L2 norm of all of x. torch.linalg.vector_norm of a whole CPU float32 tensor sums it in one pass with
    float32 accumulators: off by 2e-4 at 2^24 elements, 2e-3 at 2^25 (against a float64 norm). The norms of
    blocks, then the norm of those, stay within 1e-7 there, as fast; half dtypes accumulate in float32."""
    flat = x.reshape(-1)
    whole = flat.numel() - flat.numel() % block
    acc = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else None
    total = torch.linalg.vector_norm(flat[:whole].view(-1, block), dim=1, dtype=acc).square().sum()
    if whole < flat.numel():
        total = total + torch.linalg.vector_norm(flat[whole:], dtype=acc).square()
    return total.sqrt().to(x.dtype)


def int64(x):
    """An int as a 0-d int64 tensor (two's complement for seeds of 2^63 and up), on the host as the
    scalars are: kernels take it as an argument, and a new value does not compile again."""
    return torch.tensor(x - (1 << 64) if x >= 1 << 63 else x, dtype=torch.int64)


def size(sizes, name):
    if sizes is None or name not in sizes:
        raise ValueError(f"dim {name} cannot be read off the inputs: pass sizes={{'{name}': ...}} to step()")
    return int(sizes[name])
