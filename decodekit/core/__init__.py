"""The engine core: block allocator, paged KV cache, scheduler, runner, sampler and the step loop."""
