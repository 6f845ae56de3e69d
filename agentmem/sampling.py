"""Next-token choice for every row of a forward at once: one sampling call, each row its own settings.

The scheduler (:mod:`agentmem.scheduler`) runs one LM-head product over the last hidden state of
every turn in a forward and picks all their next tokens here, in one pass, then reads them to
the host in one copy. Each turn keeps its own temperature, top-k, top-p and random stream:

- ``temperature == 0`` is greedy: the argmax of the logits.
- Otherwise the logits are divided by the temperature, cut to the ``top_k`` likeliest tokens
  (0: all), then to the smallest set of the likeliest whose probability reaches ``top_p``, the
  order transformers' ``TemperatureLogitsWarper``, ``TopKLogitsWarper`` and
  ``TopPLogitsWarper`` apply (ties at the top-k cut are broken by rank instead of all kept).
- The token is drawn by inverse transform sampling: the row's uniform ``u`` picks the first token
  whose cumulative probability exceeds ``u`` (a draw that rounds up to the total takes the last
  token kept). The uniforms come from each turn's own :class:`random.Random` on the host, so a
  seeded turn draws the same numbers whether it ran alone or batched with others (its reply is
  the same to the rounding of batched products), and a reply read in several rounds (compacting
  between them) draws on from where it was instead of restarting its seed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from agentmem.cache import to_device
from agentmem.errors import InvalidInput


@dataclass
class Sampling:
    """One turn's way of choosing tokens; ``rng`` draws one uniform per token it samples."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise InvalidInput(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise InvalidInput(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidInput(f"top_k must be a non-negative integer, got {self.top_k!r}")

    @classmethod
    def of(cls, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
           seed: int | random.Random | None = None) -> Sampling:
        """Settings with a random stream: a new one from ``seed`` (an int), ``seed`` itself (a
        :class:`random.Random` carried on from an earlier round), or from the OS (None)."""
        rng = seed if isinstance(seed, random.Random) else random.Random(seed)
        return cls(temperature, top_p, top_k, rng)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = Sampling()  # draws nothing, so one shared instance serves every greedy read


def sample_rows(logits: torch.Tensor, rows: Sequence[Sampling]) -> torch.Tensor:
    """The next token ``(B,)`` of each row of ``logits`` ``(B, vocab)``, chosen as ``rows[b]`` says
    (module docstring); on the logits' device, with one host-to-device copy of the settings."""
    if len(rows) != logits.shape[0]:
        raise InvalidInput(f"{len(rows)} sampling settings for {logits.shape[0]} rows of logits")
    logits = logits.float()
    best = logits.argmax(-1)
    if all(row.greedy for row in rows):
        return best
    vocab = logits.shape[-1]
    settings = to_device([[row.temperature or 1.0, row.top_p, row.top_k or vocab,
                           0.0 if row.greedy else row.rng.random(), float(row.greedy)] for row in rows],
                         logits.device, dtype=torch.float32)
    temperature, top_p, top_k, uniform, greedy = settings.unbind(-1)
    ordered, order = (logits / temperature[:, None]).sort(-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)
    kept = ordered.masked_fill(rank >= top_k[:, None], -torch.inf)
    probs = kept.softmax(-1)
    mass_before = probs.cumsum(-1) - probs  # the likeliest token always stays: nothing comes before it
    kept = kept.masked_fill((mass_before >= top_p[:, None]) & (top_p[:, None] < 1), -torch.inf)
    cumulative = kept.softmax(-1).cumsum(-1)
    pick = torch.searchsorted(cumulative, (uniform * cumulative[:, -1])[:, None], right=True)
    # The kept tokens are a prefix of the order (none in a row of NaN logits: its pick stays in range).
    last_kept = (kept.isfinite().sum(-1, keepdim=True) - 1).clamp(min=0)
    sampled = order.gather(-1, torch.minimum(pick, last_kept))[:, 0]  # a draw rounded up to 1 stays in it
    return torch.where(greedy.bool(), best, sampled)
