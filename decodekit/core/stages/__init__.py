"""The stages of the step loop, one module each: propose -> schedule -> forward -> process -> select -> stop -> emit.

`schedule` is `decodekit.core.scheduler`; the engine (`decodekit.core.engine.Engine.step`) runs them in order and
passes each stage's output to the next.
"""
