"""The engine (layer 2): the step loop and its stages, the scheduler and KV blocks, the model runners, plans and
the registry. It imports `decodekit.api` and `decodekit.models`, never a front-end (docs/architecture.md)."""
