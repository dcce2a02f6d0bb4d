"""The engine (layer 3): the step loop and its stages, the scheduler, requests and their plans, the registry. It
imports `decodekit.api`, `decodekit.models` and model execution through its face (`decodekit.execution`), never a
front-end (docs/architecture.md)."""
