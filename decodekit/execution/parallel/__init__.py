"""Tensor parallelism: one model split over N processes on torch.distributed (gloo on CPUs, NCCL on GPUs).

- `group.py`: the process group (torchrun's conventions: `MASTER_ADDR`/`MASTER_PORT`, rank, world size), the
  collective timeout, and `CommCounter`, which counts the bytes each step's all-reduces and broadcasts move;
- `shard.py`: which models split by N (`shard_refusal`, naming the numbers that do not divide), slicing a model's
  linear layers into a rank's shard (Megatron: column-parallel q/k/v and gate/up, row-parallel o and down), and
  the one all-reduce after each row-parallel product (`RowParallel` in the fused decoder, forward hooks in
  transformers' own forward);
- `worker.py`: the loop ranks 1..N-1 run: take the step's inputs rank 0 broadcasts, run the same forward on their
  shard of the weights and of the KV pool;
- `ray_ranks.py`: the same workers as Ray actors placed by a placement group (`tensor_parallel_backend: ray`);
- `runner.py`: rank 0's side (`TensorParallelRunner`): start the workers, broadcast each step's inputs, run rank 0's
  shard, watch the workers (a dead one fails the step and every later one with `EngineDeadError`).

With `tensor_parallel_size` 1 only `shard_refusal` is read (by the plan), and nothing here runs.
"""
