"""`decodekit serve RECIPE`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) for any recipe.

The recipe gives the model (and draft), the engine limits and every request's defaults (sampling, processors,
stopping criteria, strategy); each request's fields are merged over them. See docs/serving.md.

Modules: `protocol` (the wire shapes), `convert` (requests to `SamplingParams`, outputs to responses and chunks),
`errors` (OpenAI's error JSON), `service` (the engine, admission, request groups), `streaming` (server-sent events
and disconnects), `metrics` (Prometheus), `app` (the FastAPI app and uvicorn).
"""

from decodekit.serve.app import ServeOptions, build_app, create_app, run_server

__all__ = ["ServeOptions", "build_app", "create_app", "run_server"]
