"""`Pool`: the engine's paged KV state and the model it runs, the one owner of both.

The state is a value (`leyline_jax.PagedKVState`); every change goes through a method here,
which calls the functional core (the allocator for pages and references, `apply_directives`
for edits, `paged.extend` for the ragged step) and keeps the state it returns. The sessions,
the prefix caches, the scheduler, the runner and the snapshots all hold the one `Pool`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

import leyline_jax as ll
from leyline_jax import allocator, paged
from leyline_jax.model import Split
from leyline_jax.sharding import MeshConfig, shard_model


class Pool:
    def __init__(self, model, config, mesh: MeshConfig | None = None):
        if mesh is not None and not isinstance(mesh, MeshConfig):
            raise TypeError(f"mesh must be a leyline_jax.sharding.MeshConfig, got {mesh!r}")
        self.mesh = mesh
        self.model = model if mesh is None else shard_model(model, mesh)
        self.graph = Split.of(self.model)
        self.state = ll.init_state(self.model.config, **config.state_args(), mesh=mesh)
        self.page_size = config.page_size

    # ---- pages -------------------------------------------------------------------------------
    def free_count(self) -> int:
        return len(allocator.free_pages(self.state))

    def seq_pages(self, seq: int) -> list[int]:
        return allocator.seq_pages(self.state, seq).tolist()

    def still_needs(self, seq: int, pending: int, new_left: int) -> int:
        return allocator.still_needs(self.state, seq, pending, new_left)

    def retain(self, pages: Sequence[int]) -> None:
        if len(pages):
            self.state = allocator.retain(self.state, pages)

    def release(self, pages: Sequence[int], *, zero: bool = False) -> None:
        if len(pages):
            self.state = allocator.release(self.state, pages, zero=zero)

    def open(self, seq: int, pages: Sequence[int] = (), tokens: Sequence[int] = ()) -> None:
        """Open `seq` holding `tokens` in the full pages `pages` (none: empty)."""
        self.state = allocator.adopt(self.state, seq, pages, tokens)

    def adopt_partial(self, seq: int, pages: Sequence[int], tokens: Sequence[int]) -> None:
        """Open `seq` holding `tokens` in `pages`, the last one partly filled (a restore)."""
        self.state = allocator.adopt(self.state, seq, pages, tokens, partial=True)

    def free(self, seq: int) -> None:
        self.state = allocator.free(self.state, seq)

    # ---- device work -------------------------------------------------------------------------
    def apply(self, seq: int, directives) -> ll.Applied:
        """Apply a directive batch to `seq` (`leyline_jax.apply_directives`); what it did."""
        self.state, done = ll.apply_directives(self.model, self.state, seq, directives, report=True)
        return done

    def extend(self, seqs: list[int], blocks: list[list[int]]):
        """One ragged step appending blocks[i] to seqs[i]; the step's logits, padded to its row
        bucket ([bucket(len(seqs)), vocab])."""
        self.state, logits = paged.extend(
            self.model, self.state, seqs, blocks, graph=self.graph, padded=True
        )
        return logits

    def read_pages(self, ids) -> tuple[np.ndarray, np.ndarray]:
        """Host copies of the pages `ids` (`paged.read_pages`; the state is not changed)."""
        return paged.read_pages(self.state, ids)

    def load_pages(self, moved: np.ndarray, rotated: np.ndarray) -> np.ndarray:
        """Write saved pages into free ones (`paged.load_pages`); the pages, each holding one
        reference for the caller to `release`."""
        self.state, pages = paged.load_pages(self.state, moved, rotated)
        return pages
