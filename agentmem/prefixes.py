"""Shared prefixes: a tenant's sessions that start with the same tokens hold those rows once.

Agents of one tenant open with the same system prompt and tool definitions, often thousands of
tokens: 32 agents with a 2k-token prompt would hold 32 copies (and read it 32 times). The
index lists the full blocks of raw rows at the start of a session's rows, keyed by the tokens
they hold; a new session starting with the same tokens takes those blocks (each gains a
holder, :meth:`~agentmem.pool.BlockPool.share`) and reads only the rest.

A block's key hashes the previous block's key with its own ``block_size`` token ids, so one key
names the whole prefix up to it (LMCache's chunk hashes and SGLang's radix tree find prefixes
the same way). Only full blocks are listed: nothing is written into them again, so sharing
them needs no copy. Entries are per tenant: no tenant ever gets another's blocks. The index
holds each block it lists, so a prompt outlives the session that read it, until
:meth:`PrefixIndex.drop` lets go.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

import torch

from agentmem.errors import InvalidInput
from agentmem.pool import BlockPool, PagedRows


class PrefixIndex:
    """Full blocks of raw prefix rows, per tenant, across every layer's pool (one pool per layer)."""

    def __init__(self, pools: Sequence[BlockPool]) -> None:
        if not pools or len({pool.block_size for pool in pools}) != 1:
            raise InvalidInput("a prefix index needs one pool per layer, all with the same block size")
        self.pools = list(pools)
        self.block_size = pools[0].block_size
        # tenant -> block key -> per layer, the block of each KV head holding those tokens
        self._entries: dict[str, dict[bytes, list[tuple[int, ...]]]] = {}
        # Times listings were forgotten (drop, drop_unheld): a session that offered its prefix before the last
        # one may hold it unlisted (listed with another session's blocks, since dropped), so must offer again.
        self.drops = 0

    def keys(self, token_ids: Sequence[int]) -> list[bytes]:
        """The chained key of every full block of ``token_ids``."""
        return list(self._chained_keys(token_ids))

    def _chained_keys(self, token_ids: Sequence[int]) -> Iterator[bytes]:
        """:meth:`keys`, one at a time: a lookup stops hashing at its first key not listed."""
        key = b""
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            block = b"".join(int(t).to_bytes(8, "little", signed=True) for t in token_ids[start : start + self.block_size])
            key = hashlib.blake2b(key + block, digest_size=16).digest()
            yield key

    def _listed(self, tenant: str, token_ids: Sequence[int]) -> list[list[tuple[int, ...]]]:
        """The tenant's listed blocks of the longest listed prefix of ``token_ids``, block position by position."""
        entries, found = self._entries.get(tenant, {}), []
        for key in self._chained_keys(token_ids):
            if key not in entries:
                break
            found.append(entries[key])
        return found

    def publish(self, tenant: str, rows: Sequence[PagedRows], token_ids: Sequence[int]) -> int:
        """List the full blocks of the raw prefix ``rows`` (a session's, one per layer) hold for ``token_ids``
        (the session's tokens); returns how many block positions (each a block per layer and KV head)
        were new to the index."""
        if len(rows) != len(self.pools) or any(r.pool is not pool for r, pool in zip(rows, self.pools)):
            raise InvalidInput(f"a session's rows in each of the index's {len(self.pools)} pools are needed")
        full = min(min(r.raw_prefix for r in rows), len(token_ids)) // self.block_size
        entries = self._entries.setdefault(tenant, {})
        new = 0
        for i, key in enumerate(self.keys(token_ids[: full * self.block_size])):
            if key in entries:
                continue
            blocks = [tuple(head[i] for head in r.blocks) for r in rows]
            for pool, layer_blocks in zip(self.pools, blocks):
                pool.share(layer_blocks)
            entries[key] = blocks
            new += 1
        return new

    def adopt(self, tenant: str, token_ids: Sequence[int], kv_heads: int) -> tuple[list[PagedRows], int]:
        """A new session's rows (one per layer) holding the longest listed prefix of ``token_ids``, and how
        many tokens that covers. The last token is never covered: reading it gives the session its logits."""
        if kv_heads < 1:
            raise InvalidInput(f"a session needs at least one KV head, got {kv_heads}")
        found = self._listed(tenant, token_ids[:-1])
        if found and len(found[0][0]) != kv_heads:
            raise InvalidInput(f"the tenant's prefixes have {len(found[0][0])} KV heads, not {kv_heads}")
        covered = len(found) * self.block_size
        sessions = []
        for layer, pool in enumerate(self.pools):
            rows = PagedRows(pool, kv_heads)
            rows.take_shared([[blocks[layer][h] for blocks in found] for h in range(kv_heads)], covered)
            rows.raw_prefix = covered
            sessions.append(rows)
        return sessions, covered

    def share_into(self, tenant: str, rows: Sequence[PagedRows], token_ids: Sequence[int]) -> int:
        """Give a session's rows (one per layer, holding ``token_ids``) the blocks ``tenant`` listed for the full
        blocks of their raw prefix, where those hold the very bytes the session's own do, and let its own go:
        a session resumed from the store, written into blocks of its own, holds its tenant's prompt shared
        again. Rows that differ in any bit (read in another batch, stored rounded) keep their own blocks, so
        no session's rows change. Returns how many blocks went back, over every layer and KV head."""
        if len(rows) != len(self.pools) or any(r.pool is not pool for r, pool in zip(rows, self.pools)):
            raise InvalidInput(f"a session's rows in each of the index's {len(self.pools)} pools are needed")
        full = min(min(r.raw_prefix for r in rows), len(token_ids)) // self.block_size
        listed = self._listed(tenant, token_ids[: full * self.block_size])
        if not listed:
            return 0
        pairs = [[(h, i, r.blocks[h][i], blocks[layer][h]) for h in range(r.kv_heads) for i, blocks in enumerate(listed)]
                 for layer, r in enumerate(rows)]
        same = iter(torch.cat([pool.same_blocks([own for *_, own, _ in layer], [theirs for *_, theirs in layer])
                               for pool, layer in zip(self.pools, pairs)]).tolist())  # one read of the device
        swapped = 0
        for r, layer in zip(rows, pairs):
            for (head, index, own, theirs), equal in zip(layer, same):  # takes this layer's answers from ``same``
                if equal and own != theirs:
                    r.swap_block(head, index, theirs)
                    swapped += 1
        return swapped

    def drop(self, tenant: str) -> None:
        """Forget the tenant's prefixes; their blocks are freed once no session holds them."""
        for blocks in self._entries.pop(tenant, {}).values():
            for pool, layer_blocks in zip(self.pools, blocks):
                pool.release(layer_blocks)
        self.drops += 1

    def drop_unheld(self) -> int:
        """Forget every listed block position no session holds any more (the index its only holder, in every
        layer and KV head), freeing its blocks: a prompt cached for sessions to come gives way to room for
        sessions now. Returns how many blocks went back, over every layer and KV head."""
        freed = 0
        for entries in self._entries.values():
            unheld = [key for key, blocks in entries.items()
                      if all(pool.holders(b) == 1 for pool, layer in zip(self.pools, blocks) for b in layer)]
            for key in unheld:
                for pool, layer_blocks in zip(self.pools, entries.pop(key)):
                    pool.release(layer_blocks)
                    freed += len(layer_blocks)
        self.drops += freed > 0
        return freed

    def listed_blocks(self, tenant: str) -> int:
        """Blocks listed for ``tenant``, over every layer and KV head."""
        return sum(len(layer) for blocks in self._entries.get(tenant, {}).values() for layer in blocks)
