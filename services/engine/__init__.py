"""The engine: one model's forward pass over a step's flat batch of sequences.

What it owns: the step's layout (batch.py), attention over the paged KV pool (attention.py,
kv_cache.py), the forward itself (flat_model.py), compiling it (compiler.py; a step as one
graph over a persistent buffer: step_graph.py), what large products run in (gemm.py),
weight-only quantisation (quant.py) and tensor parallelism (tensor_parallel.py). It imports
nothing of gRPC, Redis or the services' settings: the verifier and the drafter build it from
their settings and drive it.
"""
