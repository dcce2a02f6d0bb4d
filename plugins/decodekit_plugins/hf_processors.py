"""`hf_logits_processor`: run a transformers-style logits processor instance inside decodekit.

Python code names it through `decodekit.hf_logits_processor(instance)`, which builds the request's processor entry:

    SamplingParams(processors=[hf_logits_processor(transformers.NoRepeatNGramLogitsProcessor(2))])

A recipe cannot: it holds no Python objects, so naming `hf_logits_processor` there fails with a message that points
to the class form (`decodekit.hf_processor`, registered by a plugin). The adapter itself (batching, copies, masks)
is `decodekit.HFProcessorAdapter`; docs/transformers-processors.md is the migration guide.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from pydantic import Field, PrivateAttr, field_validator, model_validator

from decodekit import hookimpl
from decodekit.api.hf_adapter import HFProcessorAdapter
from decodekit.api.params import StrictParams

_NEEDS_AN_INSTANCE = (
    "needs a transformers logits processor instance, which only Python code can give: "
    "`SamplingParams(processors=[decodekit.hf_logits_processor(MyProcessor(...))])`. A recipe names a processor "
    "class that a plugin registered with `decodekit.hf_processor` instead (docs/transformers-processors.md)"
)


class HFLogitsProcessor(HFProcessorAdapter):
    """Run a transformers-style logits processor instance (`decodekit.hf_logits_processor(instance)`; Python only).

    The instance is shared, not copied, by default: by every row of the request and by every other request given
    the same instance, whose rows of equal history length then go in one call. That is what transformers' own
    processors expect (they are pure functions of `input_ids` and `scores`), and copying would be wrong for some:
    an instance may hold a model (classifier-free guidance) or large tensors on the GPU. A processor that keeps
    state between calls needs its own instance per request: build one per request, or set `per_request` (a deep
    copy per request).
    """

    name = "hf_logits_processor"

    class Params(StrictParams):
        """The instance to run (any Python object callable as `(input_ids, scores) -> scores`)."""

        processor: Any = Field(description="A transformers-style logits processor instance (Python API only: "
                                            "`decodekit.hf_logits_processor(instance)`).")
        per_request: bool = Field(False, description="Give each request its own deep copy of the instance "
                                                     "(processors that keep state between calls).")

        _copy: Any = PrivateAttr(default=None)  # this request's copy, when `per_request`

        @model_validator(mode="before")
        @classmethod
        def _needs_an_instance(cls, data: Any) -> Any:
            if isinstance(data, dict) and "processor" not in data:
                raise ValueError(_NEEDS_AN_INSTANCE)
            return data

        @field_validator("processor")
        @classmethod
        def _callable_instance(cls, value: Any) -> Any:
            problem = HFProcessorAdapter.instance_problem(value)  # the wording `hf_logits_processor` uses too
            if problem is not None:
                raise ValueError(problem)
            return value

    def check_options(self, options: Any) -> None:
        """Make a `per_request` copy now, so that an instance `copy.deepcopy` cannot copy fails the request."""
        if options.per_request and options._copy is None:
            try:
                options._copy = copy.deepcopy(options.processor)
            except Exception as exc:
                raise ValueError(f"per_request: cannot copy {type(options.processor).__name__} ({exc!r}); give each "
                                 "request its own instance instead") from exc

    def hf_instance(self, options: Any, device: torch.device,
                    eos_token_ids: tuple[int, ...]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """The request's copy (`per_request`), else the instance it was given."""
        if not options.per_request:
            return options.processor
        self.check_options(options)  # options built without planning (a unit test) have no copy yet
        return options._copy


@hookimpl
def decodekit_register_processors(register: Callable[..., None]) -> None:
    """Register `hf_logits_processor` (used only when a request names it)."""
    register(HFLogitsProcessor.name, HFLogitsProcessor)
