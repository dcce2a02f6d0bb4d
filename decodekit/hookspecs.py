"""Moved to `decodekit.api.hookspecs`; this import path stays for code written against earlier docs."""

from decodekit.api.hookspecs import (
    decodekit_engine_started,
    decodekit_register_commands,
    decodekit_register_constraint_backends,
    decodekit_register_model_loaders,
    decodekit_register_processors,
    decodekit_register_proposers,
    decodekit_register_stopping_criteria,
    decodekit_register_strategies,
    decodekit_request_added,
    decodekit_request_finished,
    decodekit_step_finished,
    hookimpl,
    hookspec,
)

__all__ = [
    "decodekit_engine_started",
    "decodekit_register_commands",
    "decodekit_register_constraint_backends",
    "decodekit_register_model_loaders",
    "decodekit_register_processors",
    "decodekit_register_proposers",
    "decodekit_register_stopping_criteria",
    "decodekit_register_strategies",
    "decodekit_request_added",
    "decodekit_request_finished",
    "decodekit_step_finished",
    "hookimpl",
    "hookspec",
]
