"""`decodekit bench serve`: `decodekit serve` against `transformers serve --continuous-batching`, over HTTP.

Each server runs as a subprocess on a free loopback port (waited for through `/health`), one after the other, and
gets the same seeded chat workload (`make_chat_workload`: prompts of varied lengths, mixed `max_tokens`, some
requests greedy, some sampled with a seed) from N concurrent streaming clients. Every client is a coroutine that
takes the next request from a shared queue as soon as its previous one has finished (a closed loop), so N requests
are in flight at any time. Each server gets an untimed warm-up first.

Per request the client records, from the moment it sends the request: TTFT (the first chunk that carries text),
the end-to-end time (the stream's end), and the generated tokens, read from the usage the server returns
(`stream_options.include_usage`; transformers sends its usage with the last chunk unasked) or, where a response
carries no usage, counted as the chunks that carry text. TPOT is `(e2e - ttft) / (tokens - 1)`. Per server:
throughput (generated tokens over the wall time of the whole run), TTFT and TPOT p50 / p99, errors; then the
ratios decodekit / transformers.

The same client code (`ServerProcess`, `stream_chat`, `post_chat`) drives `benchmarks/serve_soak.py`.

The package, one concern a module: `workload` (the chat requests), `client` (HTTP: streaming, concurrent clients,
the warm-up), `process` (a server as a subprocess), `servers` (how each server is configured), `report` (figures,
ratios, table, JSON) and `run` (`run_serve_benchmark`). TTFT, TPOT and their percentiles are defined in
`decodekit.bench.metrics`.
"""
