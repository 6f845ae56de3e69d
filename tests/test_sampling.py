"""Batched sampling: each row keeps its own settings, and cuts as transformers' warpers do."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from agentmem.errors import InvalidInput
from agentmem.sampling import GREEDY, Sampling, sample_rows

VOCAB = 300


class FixedDraw(random.Random):
    """A random stream that always draws ``u``: picks a known point of the distribution."""

    def __init__(self, u: float) -> None:
        super().__init__(0)
        self.u = u

    def random(self) -> float:
        return self.u


def transformers_kept(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    """The probabilities transformers' warpers leave, in that order (temperature, top-k, top-p)."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1:
        warpers.append(TopPLogitsWarper(top_p))
    return warpers(torch.empty(1, 0, dtype=torch.long), logits[None].clone())[0].softmax(-1)


@pytest.mark.parametrize("temperature, top_p, top_k", [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 12),
                                                       (0.8, 0.5, 40), (1.0, 0.05, 0)])
def test_each_row_draws_from_the_distribution_transformers_warpers_leave(temperature, top_p, top_k):
    """Inverse transform sampling over a grid of uniforms lands on each kept token in proportion to
    its probability, and never on a token the warpers cut."""
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3)) * 3
    expected = transformers_kept(logits, temperature, top_p, top_k)
    grid = 4000
    rows = [Sampling(temperature, top_p, top_k, FixedDraw((i + 0.5) / grid)) for i in range(grid)]
    picks = sample_rows(logits.expand(grid, VOCAB), rows)
    share = torch.bincount(picks, minlength=VOCAB).double() / grid
    assert set(picks.tolist()) <= set(expected.nonzero()[:, 0].tolist())
    assert (share - expected.double()).abs().max() <= 1.5 / grid + 1e-6  # a grid point per 1/grid of mass


def test_rows_of_one_call_keep_their_own_settings():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(5))
    rows = [GREEDY, Sampling(1.0, 1.0, 1, FixedDraw(0.99)), Sampling(5.0, 1.0, 0, FixedDraw(0.999)), GREEDY]
    picks = sample_rows(logits, rows)
    assert picks[0] == logits[0].argmax() and picks[3] == logits[3].argmax()
    assert picks[1] == logits[1].argmax()  # top-k of 1 leaves the argmax whatever the draw
    ordered, order = (logits[2] / 5).sort(descending=True)  # a hot row: the draw lands deep in the tail
    cumulative = ordered.softmax(-1).cumsum(-1)
    assert picks[2] == order[torch.searchsorted(cumulative, torch.tensor([0.999 * cumulative[-1].item()]),
                                                right=True)[0]]


def test_a_seeded_stream_is_reproducible_and_carries_on_across_calls():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(7))
    first = Sampling.of(1.0, 0.95, 0, seed=11)
    again = Sampling.of(1.0, 0.95, 0, seed=11)
    drawn = [sample_rows(logits, [first]).item() for _ in range(20)]
    assert drawn == [sample_rows(logits, [again]).item() for _ in range(20)]
    carried = Sampling.of(1.0, 0.95, 0, seed=first.rng)  # goes on from where `first` left off
    assert carried.rng is first.rng and len(set(drawn)) > 1


@pytest.mark.parametrize("settings", [{"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -1},
                                      {"top_k": True}])
def test_bad_settings_are_refused(settings):
    with pytest.raises(InvalidInput):
        Sampling(**settings)


def test_one_setting_per_row():
    with pytest.raises(InvalidInput, match="2 sampling settings for 3 rows"):
        sample_rows(torch.zeros(3, VOCAB), [GREEDY, GREEDY])


def test_a_draw_at_the_top_of_the_range_stays_among_the_kept_tokens():
    """A uniform that rounds up to 1 in float32 must not fall off the kept prefix onto a cut token."""
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(9))
    rows = [Sampling(1.0, 0.5, 0, FixedDraw(1 - 2**-30)), Sampling(1.0, 1.0, 3, FixedDraw(1 - 2**-30))]
    picks = sample_rows(logits, rows)
    for row, (pick, settings) in enumerate(zip(picks, rows)):
        kept = transformers_kept(logits[row], settings.temperature, settings.top_p, settings.top_k)
        assert kept[pick] > 0


def test_top_p_of_one_cuts_nothing():
    """With float32 sums reaching 1 early, a tail token must still be drawable when top_p is 1."""
    logits = torch.zeros(1, VOCAB)
    logits[0, 0] = 40.0  # nearly all the mass on one token: the cumulative sum hits 1.0 at once
    pick = sample_rows(logits, [Sampling(1.0, 1.0, 0, FixedDraw(1 - 2**-30))])
    assert pick.item() != 0
