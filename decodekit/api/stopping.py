"""The stopping-criterion contract: plugins decide, after each new token, whether a sequence is done.

Default criteria (EOS, stop token ids, max tokens, stop strings) apply to every request and read its
`SamplingParams`; other criteria apply to the requests that name them (recipe `stopping:` or
`SamplingParams.stopping`), each with its own validated parameters (`Params`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel

from decodekit.api.params import SamplingParams
from decodekit.api.sequence import Sequence


@dataclass(frozen=True)
class StopDecision:
    """Why a sequence stops: `finish_reason` ("stop" or "length"), what matched, and where to cut the text."""

    finish_reason: str
    stop_reason: str | int | None = None
    truncate_text_at: int | None = None


class StoppingCriterion:
    """Base class of stopping criteria. Built once per engine; `check` runs after every token of its rows.

    `example` (optional): parameters with which it can stop a request (its `Params` as a mapping), for the
    composition matrix (`tests/strategies/test_composition_matrix.py`), as `LogitsProcessor.example`.

    Example:
        >>> class NewlineCount(StoppingCriterion):
        ...     name = "newlines"
        ...     class Params(BaseModel):
        ...         count: int = 2
        ...     def check(self, seq, params, eos_token_ids, options=None):
        ...         return StopDecision("stop", "newlines") if seq.text.count("\\n") >= options.count else None
    """

    name: ClassVar[str] = "criterion"
    Params: ClassVar[type[BaseModel] | None] = None
    example: ClassVar[dict[str, Any] | None] = None

    def is_active(self, params: SamplingParams) -> bool:
        """For default criteria: whether a request with these parameters uses this criterion."""
        return True

    def check_options(self, options: BaseModel | None) -> None:
        """Refuse parameters pydantic cannot (named criteria): raise `ValueError` saying why; the key path
        (`stopping[i].name`) is added. Static: runs at `decodekit recipe check` too, where no engine exists."""

    def check_options_with(self, options: BaseModel | None, info: Any) -> None:
        """Refuse parameters this engine cannot serve (a token id past `info.vocab_size`, strings without
        `info.tokenizer`): raise `ValueError`. Runs only inside an engine, after `check_options` and `setup(info)`."""

    def check(self, seq: Sequence, params: SamplingParams, eos_token_ids: tuple[int, ...],
              options: Any = None) -> StopDecision | None:
        """Return a decision to stop `seq` (whose newest token is `seq.token_ids[-1]`), or None to go on.

        `options` is the request's validated `Params` instance for this criterion (None for default criteria).
        """
        raise NotImplementedError
