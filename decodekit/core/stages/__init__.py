"""The stages of the step loop, one module each: propose -> schedule -> forward -> process -> select -> stop -> emit.

`schedule` is `decodekit.core.scheduler`; the engine (`decodekit.core.engine.Engine.step`) runs them in order and
passes each stage's output to the next. A stage that finds a request it cannot serve (its plugin raised, its
forward failed) returns it as a `Failure`, and the engine fails that request alone.
"""

from decodekit.api.sequence import Request

Failure = tuple[Request, str]
"""A request a stage could not serve, and why (the message its output's `error` gets)."""
