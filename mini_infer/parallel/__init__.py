"""Tensor parallelism: one model split over several processes, on ``torch.distributed`` (chapter 14).

The pieces:

* ``shards``: which slice of every checkpoint tensor a rank holds (Megatron-LM's column, row and
  vocabulary splits), reading only that slice from safetensors, ``ShardedQwen2Model`` (chapter
  03's model at one rank's shapes, its projections, embedding and logits meeting the other
  ranks') and ``RankGroup``, its two collectives on a process group: gloo on CPUs, NCCL on GPUs;
* ``workers``: ``launch`` (what ``engine_builder.build_engine`` calls for
  ``tensor_parallel_size > 1``) spawns ranks 1..N-1, and ``TensorParallelRunner`` (a
  ``ModelRunner``, chapter 05) sends each step's inputs to them before running rank 0's shard;
* ``bench``: ``mini-infer bench offline --tensor-parallel-size N``, and the tracing of every
  rank's steps and collectives that it and chapter 14 read.

Earlier chapters know none of this package: the model overrides three of chapter 03's methods, the
runner and the engine define the hooks (``ForwardBatch.inputs``, ``check_health``, ``close``) and
the engine builder names ``workers`` only when asked for more than one rank.
"""
