"""decodekit as an lm-evaluation-harness model (`DecodekitLM`, registered in lm-eval as "decodekit").

Importing this module registers it, so people who drive lm-eval themselves can use it:

    import decodekit.eval.model  # noqa: F401  (registers "decodekit")
    lm_eval.simple_evaluate(model="decodekit", model_args="recipe=recipes/creative.yaml", tasks=[...])

or `python -m decodekit.eval --model decodekit --model_args recipe=recipes/creative.yaml --tasks ...` (lm-eval's own
command line with the model registered; lm-eval finds no models through entry points).

How each kind of request runs, all of one call batched through the engine (continuous batching, so lm-eval's
`batch_size` is accepted and ignored):

- `loglikelihood` (multiple choice): context and continuation are tokenized as lm-eval's `hf` backend does
  (`TemplateLM._encode_pair`, the tokenizer's special tokens as `tokenizer.encode` adds them), and each pair runs as
  one prompt asking for its prompt logprobs (raw: the model, not the recipe's processors); the continuation's
  logprobs are added up, and it is greedy when every token ranks first;
- `loglikelihood_rolling` (perplexity): lm-eval's disjoint rolling windows, each scored the same way;
- `generate_until`: the recipe's parameters, processors, strategy and constraints choose the tokens; from the task
  come the stop strings (`until`, added to the recipe's) and `max_gen_toks` (the recipe's `max_tokens` otherwise).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import has_bos_prefix

from decodekit.api.errors import DecodeKitError, RequestError
from decodekit.api.params import SamplingParams
from decodekit.api.sequence import RequestOutput
from decodekit.eval.scoring import score_tails


@register_model("decodekit")
class DecodekitLM(TemplateLM):
    """An lm-eval model over a decodekit recipe: `model_args="recipe=PATH"` (with `set=key=value;key=value` for
    `--set` overrides), or in Python `DecodekitLM(recipe=Recipe, llm=LLM)` over an engine already built.

    `outputs` keeps every generation request's output and `generation_wall_s` their wall time, for the figures of
    speed `decodekit compare` reports next to the accuracy.
    """

    def __init__(self, recipe: Any = None, llm: Any = None, set: str | None = None,
                 on_output: Callable[[RequestOutput], None] | None = None, **_lm_eval_options: Any) -> None:
        super().__init__()
        from decodekit.recipe import Recipe, load_recipe

        if recipe is None:
            raise DecodeKitError("the decodekit model needs a recipe: model_args='recipe=PATH'")
        if not isinstance(recipe, Recipe):
            overrides = [item for item in (set or "").split(";") if item.strip()]
            recipe = load_recipe(Path(str(recipe)), overrides)
        self.recipe = recipe
        self.llm = llm if llm is not None else recipe.build_llm()
        self.tokenizer = self.llm.tokenizer
        self.on_output = on_output
        self.outputs: list[RequestOutput] = []
        self.generation_wall_s = 0.0

    # ---- what lm-eval asks of a model --------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        """The end-of-text token (EOS)."""
        eos = self.tokenizer.eos_token_id
        if eos is None:
            raise DecodeKitError("the tokenizer has no EOS token, which lm-eval needs")
        return int(eos)

    @property
    def prefix_token_id(self) -> int:
        """What an empty context and the first rolling window are conditioned on: BOS, else EOS (the `hf`
        backend's choice)."""
        bos = self.tokenizer.bos_token_id
        return int(bos) if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        """The longest scored window: a prompt must be shorter than the engine's context (`max_model_len`) and a
        window scores `max_length` tokens after its first."""
        return int(self.llm.engine.max_model_len) - 2

    @property
    def max_gen_toks(self) -> int:
        """Tokens to generate when a task does not say: the recipe's `max_tokens`."""
        return self.recipe.default_params().max_tokens

    @property
    def tokenizer_name(self) -> str:
        """The name lm-eval keys its cache of chat-templated prompts by."""
        return str(getattr(self.tokenizer, "name_or_path", "decodekit")).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """Token ids as the `hf` backend makes them: the tokenizer's special tokens unless told otherwise, none when
        the text already starts with the BOS text (a chat template wrote it)."""
        options = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        bos = self.tokenizer.bos_token
        if add_special_tokens is None and bos and has_bos_prefix(string, bos):
            options["add_special_tokens"] = False
        return list(self.tokenizer.encode(string, **options))

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """A conversation rendered with the tokenizer's chat template (lm-eval's `--apply_chat_template`)."""
        return str(self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=not add_generation_prompt))

    def _loglikelihood_tokens(self, requests: list[Any], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """Per (context, continuation) token pair: the continuation's log-probability and whether it is greedy."""
        windows = [(list(context) + list(continuation))[-(self.max_length + 1):] for _, context, continuation
                   in requests]
        scored = score_tails(self.llm, windows, [len(continuation) for _, _, continuation in requests],
                             on_output=self.on_output)
        failed = next((s for s in scored if isinstance(s, str)), None)
        if failed is not None:
            raise RequestError(f"a loglikelihood request of the evaluation failed: {failed}")
        return [(sum(c.logprob for c in chosen), all(c.rank == 1 for c in chosen)) for chosen in scored
                if not isinstance(chosen, str)]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Per text: its log-probability over lm-eval's disjoint rolling windows of `max_length` tokens."""
        windows: list[tuple[int, tuple[list[int], list[int]]]] = []
        for index, (text,) in enumerate(req.args for req in requests):
            tokens = self.tok_encode(text)
            for window in lm_utils.get_rolling_token_windows(token_list=tokens, prefix_token=self.prefix_token_id,
                                                             max_seq_len=self.max_length, context_len=1):
                windows.append((index, lm_utils.make_disjoint_window(window)))
        scores = self._loglikelihood_tokens([(None, context, continuation) for _, (context, continuation) in windows])
        totals = [0.0] * len(requests)
        for (index, _), (logprob, _) in zip(windows, scores):
            totals[index] += logprob
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Generate for every request through the recipe, cut at the task's stop strings."""
        prompts, params, stops = [], [], []
        for context, gen_kwargs in (req.args for req in requests):
            options = dict(gen_kwargs or {})
            until = options.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_tokens = int(options.get("max_gen_toks") or self.max_gen_toks)
            base = self.recipe.default_params()
            params.append(self.recipe.params_for({"max_tokens": max_tokens, "stop": [*base.stop, *until]}))
            # the context is cut from the left to leave room for the answer, as the `hf` backend does
            prompts.append(self.tok_encode(context)[-max(1, self.max_length - max_tokens):])
            stops.append(until)
        start = time.perf_counter()
        outputs = self._run(prompts, params)
        self.generation_wall_s += time.perf_counter() - start
        self.outputs.extend(outputs)
        texts = []
        for output, until in zip(outputs, stops):
            text = output.text
            for stop in until:  # the engine already stopped at them; a stop the detokenizer split is cut here too
                text = text.split(stop)[0] if stop else text
            texts.append(text)
        return texts

    def _run(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[RequestOutput]:
        """Every request in one continuous batch; a failed request fails the evaluation, naming its reason (lm-eval
        has no way to score a request that has no answer)."""
        if not prompts:
            return []
        outputs: list[RequestOutput] = self.llm.generate(prompts, params, on_output=self.on_output)
        failed = next((o for o in outputs if o.error is not None), None)
        if failed is not None:
            raise RequestError(f"a request of the evaluation failed: {failed.error}")
        return outputs
