"""One engine working through rows: the in-process job runs one, and each Ray replica holds one.

Rows flow through the engine's continuous batch in a sliding window: up to `window` requests are in the engine at
once, a new row starts as soon as one finishes, and output rows come out in input order (a finished row waits for
the rows before it), so the engine stays full without holding the whole dataset.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import pluggy

from decodekit.api.errors import DecodeKitError
from decodekit.api.startup_heap import frozen_heap
from decodekit.batch.rows import InputRow, output_row, prepare_row, uses_chat_template
from decodekit.core.plan import Components
from decodekit.core.plugin_manager import get_plugin_manager
from decodekit.core.registry import Registry
from decodekit.llm import AsyncLLM
from decodekit.recipe import Recipe
from decodekit.tool_calling import ToolPlan


class BatchWorker:
    """An engine built from a recipe, turning input rows into output rows.

    Args:
        recipe: the model, engine limits and every row's defaults.
        plugin_manager: the plugins (default: every installed one).
        llm: an `LLM` already built from the recipe (default: build one).
    """

    def __init__(self, recipe: Recipe, plugin_manager: pluggy.PluginManager | None = None, llm: Any = None):
        self.recipe = recipe
        pm = plugin_manager or get_plugin_manager()
        self.components = Components(Registry.from_plugin_manager(pm))
        self.llm = llm if llm is not None else recipe.build_llm(pm)
        self.window = 2 * self.llm.engine.config.max_num_seqs

    def run(self, rows: Iterable[InputRow]) -> Iterator[dict[str, Any]]:
        """Output rows, one per input row, in input order, yielded as soon as they and every row before them are
        done. A row that cannot run yields its error row without stopping the others. The heap is frozen out of the
        garbage collector while the rows run (`frozen_heap`: the engine's steps then skip its objects) and given back
        when the rows are done or the generator is closed."""
        with frozen_heap():
            yield from self._run(rows)

    def _run(self, rows: Iterable[InputRow]) -> Iterator[dict[str, Any]]:
        """`run`'s rows, without the frozen heap."""
        engine = self.llm.engine
        pending = iter(rows)
        order: list[InputRow] = []  # admitted rows, in input order, not yet yielded
        done: dict[int, dict[str, Any]] = {}
        running: dict[str, tuple[InputRow, ToolPlan | None]] = {}
        exhausted = False
        while True:
            while not exhausted and len(running) < self.window and len(order) < 4 * self.window:
                row = next(pending, None)
                if row is None:
                    exhausted = True
                    break
                order.append(row)
                error = self._start(row, running)
                if error is not None:
                    done[row.index] = error
            while order and order[0].index in done:
                yield done.pop(order.pop(0).index)
            if not running:
                if exhausted and not order:
                    return
                continue
            for out in engine.step():
                if out.finished and out.request_id in running:
                    row, plan = running.pop(out.request_id)
                    done[row.index] = output_row(row, plan.read_into(out) if plan is not None else out)

    async def run_async(self, rows: Sequence[InputRow], engine: AsyncLLM) -> list[dict[str, Any]]:
        """Every output row of `rows`, in their order, generated through `engine` (an `AsyncLLM` over this worker's
        engine): several calls may run at once, all their rows in the one continuous batch (how a Ray replica takes
        several batches at a time)."""
        return list(await asyncio.gather(*(self._run_one(row, engine) for row in rows)))

    async def _run_one(self, row: InputRow, engine: AsyncLLM) -> dict[str, Any]:
        try:
            prepared = prepare_row(self.recipe, self.components, self.llm, row)
            final = None
            async for out in engine.generate(prepared.text, prepared.params,
                                             request_id=f"batch-{row.id}-{uuid.uuid4().hex[:8]}",
                                             add_special_tokens=not uses_chat_template(self.recipe, row)):
                final = out
        except DecodeKitError as exc:
            return output_row(row, error=str(exc))
        if final is not None and prepared.tools is not None:
            prepared.tools.read_into(final)
        return output_row(row, final)

    def _start(self, row: InputRow, running: dict[str, tuple[InputRow, ToolPlan | None]]) -> dict[str, Any] | None:
        try:
            prepared = prepare_row(self.recipe, self.components, self.llm, row)
            request_id = f"batch-{row.id}-{uuid.uuid4().hex[:8]}"
            self.llm.engine.add_request(prepared.text, prepared.params, request_id=request_id,
                                        add_special_tokens=not uses_chat_template(self.recipe, row),
                                        final_only=True)  # a row is written from its final output alone
        except DecodeKitError as exc:
            return output_row(row, error=str(exc))
        running[request_id] = (row, prepared.tools)
        return None


def tokens_of(row: dict[str, Any]) -> int:
    """Completion tokens of an output row (0 for an error row)."""
    usage = row.get("usage")
    return int(usage["completion_tokens"]) if isinstance(usage, dict) else 0

