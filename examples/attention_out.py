"""Self-attention's core and output projection under Megatron-LM's tensor parallelism (Shoeybi et al. 2019,
"Megatron-LM: Training Multi-Billion Parameter Language Models Using Model Parallelism", §3, Figure 3b).

The column-parallel QKV projection before it leaves each rank its heads of the queries, keys and values, so
attention runs on those heads alone: each head's scores ``q @ k^T / sqrt(D)``, their softmax and dropout, and
the context ``probs @ v``. The output projection is row-parallel: each rank holds the weight's rows for its
heads, so contracting its heads' context with them (over heads and the head dim, one GEMM) is a partial sum
of the output; the allreduce completes it, then the bias, dropout and the residual follow. Heads are laid out
``[heads, s, head dim]`` for one sequence; ``scale`` is the caller's 1/sqrt(D).
"""

from coconet import Program, Replicated, Sliced, allreduce, dropout, matmul, softmax, tensordot, transpose

p = Program("attention_out", dims=("A", "S", "D", "H"))
q = p.tensor("q", ("A", "S", "D"), layout=Sliced(0))  # this rank's heads of the queries
k = p.tensor("k", ("A", "S", "D"), layout=Sliced(0))
v = p.tensor("v", ("A", "S", "D"), layout=Sliced(0))
w = p.tensor("w", ("A", "D", "H"), layout=Sliced(0))  # the output projection's rows for those heads
b = p.tensor("b", ("H",), layout=Replicated)
r = p.tensor("r", ("S", "H"), layout=Replicated)  # the residual stream
scale = p.scalar("scale")
seed = p.scalar("seed", dtype="int64")
attn_seed = p.scalar("attn_seed", dtype="int64")

probs = dropout(softmax(matmul(q, transpose(k, 1, 2)) * scale, -1), 0.1, attn_seed)
ctx = matmul(probs, v)
y = allreduce(tensordot(ctx, w, ([0, 2], [0, 1])))
p.output("out", dropout(y + b, 0.1, seed) + r)
program = p
