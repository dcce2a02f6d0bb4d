"""`BatchView`'s helpers for plugin authors: per-row histories and counts as tensors, row selection."""

from __future__ import annotations

from collections import Counter

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from decodekit import SamplingParams
from decodekit.api.processors import BatchView


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=12), min_size=1, max_size=5), st.data())
def test_token_counts_and_history_tensor_match_the_histories(histories, data):
    prompt_lens = [data.draw(st.integers(0, len(h))) for h in histories]
    view = BatchView([SamplingParams()] * len(histories), histories, prompt_lens)
    for generated_only in (False, True):
        counts = view.token_counts(10, generated_only=generated_only)
        padded = view.history_tensor(generated_only=generated_only)
        for row, history in enumerate(histories):
            ids = history[prompt_lens[row]:] if generated_only else history
            assert counts[row].tolist() == [float(Counter(ids)[t]) for t in range(10)]
            assert padded[row, : len(ids)].tolist() == ids and bool((padded[row, len(ids):] == -1).all())
    picked = view.select([len(histories) - 1])
    assert picked.histories == [histories[-1]] and picked.num_generated.tolist() == [
        len(histories[-1]) - prompt_lens[-1]]
    assert torch.equal(view.param_tensor("temperature"), torch.ones(len(histories)))
