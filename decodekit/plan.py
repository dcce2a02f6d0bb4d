"""Moved to `decodekit.core.plan` (plans) and `decodekit.api.components` (what components get, parameter checks);
this import path stays for code written against earlier docs."""

from decodekit.api.components import ComponentInfo, PlanError, format_validation_error, validate_options
from decodekit.core.plan import Components, CriterionStage, Plan

__all__ = [
    "ComponentInfo",
    "Components",
    "CriterionStage",
    "Plan",
    "PlanError",
    "format_validation_error",
    "validate_options",
]
