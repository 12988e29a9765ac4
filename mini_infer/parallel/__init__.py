"""Tensor parallelism: one model split over several processes, on ``torch.distributed`` (chapter 14).

The pieces:

* ``shards``: which slice of every checkpoint tensor a rank holds (Megatron-LM's column, row and
  vocabulary splits), reading only that slice from safetensors, and ``RankGroup``, the model's
  ``TensorParallel`` hook (chapter 03) on a process group: gloo on CPUs, NCCL on GPUs;
* ``workers``: ``launch`` (what ``engine_builder.build_engine`` calls for
  ``tensor_parallel_size > 1``) starts ranks 1..N-1, and ``TensorParallelRunner`` (a
  ``ModelRunner``, chapter 05) sends each step's inputs to them before running rank 0's shard;
* ``__main__``: ``torchrun ... -m mini_infer.parallel <mini-infer command>``, every rank started
  by ``torchrun``, on one machine or several.

Earlier chapters know none of this module: the model, the runner and the engine define the hooks
(``model.TensorParallel``, ``ForwardBatch.inputs``, ``check_health``, ``close``) and the engine
builder names ``workers`` only when asked for more than one rank.
"""
