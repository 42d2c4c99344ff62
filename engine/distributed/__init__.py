"""Tensor parallelism inside one engine process group (docs/architecture.md, Tensor parallelism).

``shard.py`` (which heads, MLP columns and vocabulary rows a rank holds), ``group.py`` (the rank
processes, their ``torch.distributed`` group, the batch broadcast and the death watch),
``batch_wire.py`` (a ForwardBatch as one int64 tensor), ``parallel_linear.py`` (Megatron-style
column/row-parallel linears, the vocabulary-parallel embedding and lm_head), ``tp_model.py`` (a
Llama-family model built and loaded as one rank's shard), ``follower.py`` (the loop of ranks 1..N-1).
"""
