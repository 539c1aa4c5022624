"""One pipeline stage of a GPT-3 layer (Brown et al. 2020; CoCoNet §6.3).

Each stage is a model-parallel group. The residual stream ``x`` arrives from
the previous stage, the stage's row-parallel GEMM produces partial sums, and
``allreduce → +bias → dropout → +residual`` ends in a send to the same rank of
the next stage. The MLP activation ``h`` (the stage's column-parallel half) is
an input here. CoCoNet's rewrite sends slices instead of the replicated value
and all-gathers on the receiving stage.
"""

from coconet import Program, Replicated, Sliced, allreduce, dropout, matmul, recv, send

p = Program("gpt_pipeline", dims=("B", "S", "H"))
x = recv(p, "x", ("B", "S", "H"), layout=Replicated)
h = p.tensor("h", ("B", "S", "4*H"), layout=Sliced(-1))
w = p.tensor("w", ("4*H", "H"), layout=Sliced(0))
b = p.tensor("b", ("H",), layout=Replicated)
seed = p.scalar("seed", dtype="int64")

y = allreduce(matmul(h, w))
send(dropout(y + b, 0.1, seed) + x)
program = p
