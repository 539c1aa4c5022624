import pytest
import torch

from coconet.tuner import bandwidth
from coconet.tuner.bandwidth import close, kernels, memory_bandwidths


@pytest.mark.parametrize("threads", [1, 3])
def test_the_states_kernel_updates_every_row_once(threads):
    # a rate means something only if the kernel did the work it is credited with, over every row; 1000 rows
    # split over three threads leave a last part that is not a multiple of the others
    probe = kernels(16 * 1000, threads)
    try:
        add, states = probe
        assert (add.name, add.nbytes) == ("a += b", 3 * 2000 * 4)
        assert states.nbytes == 7 * 1000 * 4
        x, y, z, g = states.buffers
        g.copy_(torch.arange(1000, dtype=torch.float32) % 7 - 3)
        x.copy_(torch.arange(1000, dtype=torch.float32))
        x0, y0, z0 = x.clone(), y.clone(), z.clone()
        states.run()
        assert torch.equal(x, x0 + g) and torch.equal(y, y0 + g * g) and torch.equal(z, z0 - g)
    finally:
        close(probe)


def test_the_probe_takes_every_kernel_and_keeps_add_without_a_compiler(monkeypatch):
    rates = memory_bandwidths(nbytes=2**22, repeats=2)
    assert set(rates) == {"a += b", "x += g, y += g*g, z -= g"} and min(rates.values()) > 1e8
    monkeypatch.setattr(bandwidth, "_states_kernel", lambda: None)  # as where no C compiler is found
    assert set(memory_bandwidths(nbytes=2**22, repeats=2)) == {"a += b"}
