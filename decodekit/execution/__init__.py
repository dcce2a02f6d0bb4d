"""Model execution (layer 2): run these items over this paged pool, give logits (and hidden states).

The face the engine uses, and the only names `decodekit.core` imports from this package:

- `plan_execution(loaded, config, draft)` -> `ExecutionPlan`: the one decision of how a model (and its draft) runs
  (`plan.py`);
- `ModelExecutor(loaded, plan, num_blocks)`: the model, its KV pool and block allocator, run as its plan says
  (`executor.py`); `ModelExecutor.run(items, block_copies)` is one packed forward, `ModelExecutor.decode_run`
  several one-row steps of one sequence natively (drawn at a temperature with `RunDraws`);
- `ForwardItem`: one sequence's part of a forward; `BlockAllocator`: the pool's blocks, which the engine's scheduler
  drives;
- `cached_step_cost(executor, name)`: the model's forward time by rows on this machine, measured once and cached on
  disk (`step_cost.py`).

Inside: `attention/` (the paged KV pool, the attention functions, the attention probe), `fused/` (the fused decoder,
its weight matrices, re-laid linears), `kernels/` (native C for the CPU, Triton for the GPU), `cuda_graphs.py`,
`runner.py` (the forward), `geometry.py`, `blocks.py`, `parallel/` (a model split over ranks: `tensor_parallel_size`).
"""

from decodekit.execution.blocks import BlockAllocator
from decodekit.execution.executor import ModelExecutor
from decodekit.execution.fused.layer_stack import RunDraws, RunInterrupt
from decodekit.execution.items import ForwardItem
from decodekit.execution.plan import ExecutionPlan, plan_execution
from decodekit.execution.step_cost import cached_step_cost

__all__ = ["BlockAllocator", "ExecutionPlan", "ForwardItem", "ModelExecutor", "RunDraws", "RunInterrupt",
           "cached_step_cost", "plan_execution"]
