"""Where a cache's rows sit in RoPE positions, and moving them so a session reads past the model's window.

A model attends correctly only to keys at most its context window away, in RoPE positions.
A session that compacts keeps few rows, but its logical length (every token it has read) keeps
growing; if new tokens took their logical positions, a compacting session would still stop at
the window. So positions in use are decoupled from the token count by a :class:`Placement`:

- tokens before ``protect`` (the protected prompt, the attention sinks) keep their positions;
- tokens in ``[protect, boundary)`` — by construction all compacted — are squeezed linearly into
  ``[protect, protect + room)`` (positional interpolation on the old rows, as SelfExtend groups
  distant positions: nearby order kept, distances shrunk);
- tokens from ``boundary`` on (the raw tail when the placement was made, everything read since
  and, with an exact neighbour window, the last compacted tokens before the tail) are shifted
  down by ``offset = boundary − protect − room``: their distances to each other, and to every
  new token, are exactly what they were.

RoPE rotations compose, so a key rotated for one position is moved to another by one more
rotation (:meth:`Engine.rotate <agentmem.engine.Engine.rotate>`): :func:`replace_positions`
re-rotates every row from where the cache's placement put it to where a new placement puts it.
The map is a function of a row's logical position (which compacted rows record), so placements
never compound: each is computed from the token positions, whatever came before.

What is exact: attention among the raw tail and new tokens (a uniform shift keeps every
relative distance). What is approximate: the compacted rows' distances to the rest, squeezed;
their β and values were fitted at the positions they had. The default placement's room is half
the window less the protected prefix (:func:`placement_room`) and a quarter is the margin kept
free, so a session re-places about once per quarter window it reads, less its raw tail. Each
re-placement rounds the moved keys to the cache's dtype again (``benchmarks/rounding.py``
measures what that adds up to in bf16).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentmem.errors import InvalidInput

# Tokens at the start of a session that keep their positions when it is re-placed, as
# StreamingLLM keeps its attention sinks (more when the protected system prompt is longer).
SINK_TOKENS = 4
# Slots re-rotated per step: the angles of a block of slots are (heads, block, head_dim / 2) float64.
_BLOCK = 8192


@dataclass(frozen=True)
class Placement:
    """Logical token positions → RoPE positions (module doc); the default is the identity."""

    protect: int = 0
    boundary: int = 0
    room: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.protect <= self.boundary or not 0 <= self.room <= self.boundary - self.protect:
            raise InvalidInput(f"a placement needs 0 <= protect <= boundary and room <= boundary - protect, got {self}")

    @property
    def offset(self) -> int:
        """How far below its logical position a token read after the boundary sits."""
        return self.boundary - self.protect - self.room

    @property
    def is_identity(self) -> bool:
        return self.offset == 0

    def positions(self, logical: torch.Tensor) -> torch.Tensor:
        """RoPE positions (int64) of tokens at ``logical`` positions (any integer tensor)."""
        logical = logical.long()
        if self.is_identity:
            return logical
        squeezed = self.protect + (logical - self.protect) * self.room // max(1, self.boundary - self.protect)
        shifted = logical - self.offset
        return torch.where(logical < self.protect, logical, torch.where(logical < self.boundary, squeezed, shifted))

    def as_list(self) -> list[int]:
        return [self.protect, self.boundary, self.room]


IDENTITY = Placement()


def placement_margin(engine) -> int:
    """Positions a session keeps free below the model's window: a compaction reads its reference
    text on top of the cache, and a re-placement is due once the next token would pass this."""
    return engine.max_context // 4


def placement_room(engine, protect: int, tail: int = 0) -> int:
    """Positions the compacted past is squeezed into: half the window less the protected prefix,
    which leaves a quarter window (after the margin) for the raw tail and new tokens. Of the
    placements ``benchmarks/long.py`` compares, half the window kept most (a quarter or an eighth
    squeezes the newest compacted rows too close to the tail). Less when a raw ``tail`` that
    compaction cannot shorten (its recent rows) would leave under an eighth of the window for new
    tokens; 0 when the prefix takes half the window or more (the compacted past then shares one
    position)."""
    window = engine.max_context
    free = window - placement_margin(engine) - protect
    return max(0, min(free - window // 4, free - tail - window // 8))


def placement_for(cache, *, protect: int, room: int, exact: int = 0) -> Placement:
    """The placement that squeezes every compacted token of ``cache`` (after ``protect``) into ``room`` positions.

    Its boundary is where the raw tail starts, so the whole tail keeps its distances; with
    ``exact``, so do the last ``exact`` compacted tokens (SelfExtend's neighbour window: the
    boundary moves back by ``exact``, at most ``room``, and the older rows share the rest of
    ``room``), and the next position is the same as without it.
    """
    if exact < 0:
        raise InvalidInput(f"exact must be >= 0, got {exact}")
    exact = min(exact, room)
    boundary = max(min(protect, cache.tail_start), cache.tail_start - exact)
    protect = min(protect, boundary)
    return Placement(protect, boundary, min(max(0, room - (cache.tail_start - boundary)), boundary - protect))


def check_boundary(placement: Placement, tail_start: int) -> None:
    """Refuse (:class:`InvalidInput`) a placement whose boundary passes the raw tail's start
    (``tail_start``, a token index): every raw row must keep its distances."""
    if placement.boundary > tail_start:
        raise InvalidInput(f"a placement's boundary ({placement.boundary}) must not pass the raw tail's start "
                           f"({tail_start}): raw rows must keep their distances")


def replace_positions(engine, cache, placement: Placement):
    """A copy of ``cache`` whose rows sit where ``placement`` puts them (``cache`` is left as it was).

    Every row's key is rotated from its position under the cache's placement to its position
    under the new one; values, β and the token log are unchanged. Kept reference queries move
    with the tail (they were recorded at the newest positions). The new boundary may not pass
    the raw tail's start: every raw row keeps its distances, which :func:`placement_for` ensures.
    """
    tail_start = cache.tail_start
    check_boundary(placement, tail_start)
    old = cache.placement
    moved = cache.clone()
    inv_freq = engine.model.base_model.rotary_emb.inv_freq
    for layer in moved.layers:
        for start in range(0, layer.length, _BLOCK):
            end = min(layer.length, start + _BLOCK)
            logical = layer.slot_positions(start, end, tail_start)
            unknown = logical < 0  # padding slots: nothing to move
            shift = torch.where(unknown, 0, placement.positions(logical) - old.positions(logical))
            keys = layer.keys_view(start, end)
            keys.copy_(rotate_by(keys, shift, inv_freq))
        layer.shift_query_marks(old.offset - placement.offset)
    moved.placement = placement
    return moved


def rotate_by(rotated: torch.Tensor, shift: torch.Tensor | int, inv_freq: torch.Tensor) -> torch.Tensor:
    """RoPE-rotated vectors ``(..., head_dim)`` moved ``shift`` positions later (``shift`` broadcasts
    against ``rotated.shape[:-1]``), computed in float32 from float64 angles; returned in float32.

    RoPE rotates each frequency pair by ``position · θ``, so a vector rotated for position ``p``
    becomes the one for ``p + shift`` by one more rotation of ``shift · θ`` (the rotary module's
    attention scaling multiplies both and is left out).
    """
    from transformers.models.llama.modeling_llama import rotate_half  # the same in every supported architecture

    shift = torch.as_tensor(shift, device=rotated.device, dtype=torch.float64)
    angles = shift[..., None] * inv_freq.to(rotated.device, torch.float64)
    cos, sin = (torch.cat([f, f], dim=-1).float() for f in (angles.cos(), angles.sin()))
    x = rotated.float()
    return x * cos + rotate_half(x) * sin
