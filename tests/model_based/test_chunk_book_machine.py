"""The host tier's chunk book (gms.server.tiers.chunk_book), stateful: any order of
moves the shell can make keeps every count what the chunks add up to, a chunk in
one phase at a time, and a move out of turn refused (ChunkError), changing nothing."""

from __future__ import annotations

import copy

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from gms.server.tiers.chunk_book import ChunkBook, ChunkError, Phase, chunk_name, parse_chunk_name

CHUNK = 4


class ChunkBookMachine(RuleBasedStateMachine):
    @initialize()
    def start(self):
        self.book = ChunkBook(CHUNK)
        self.ids = 0
        # The reference: every chunk's phase and size, and the copies, kept the plain way.
        self.phase: dict[str, Phase] = {}
        self.size: dict[str, int] = {}
        self.pool: list[str] = []
        self.copies: dict[str, list[str]] = {}

    def _new_id(self, prefix: str) -> str:
        self.ids += 1
        return f"{prefix}{self.ids}"

    def _in(self, phase: Phase) -> list[str]:
        return sorted(c for c, p in self.phase.items() if p is phase)

    @rule(sizes=st.lists(st.integers(1, 3 * CHUNK), min_size=1, max_size=3), made=st.booleans())
    def make_for_work(self, sizes, made):
        ids = [(self._new_id("a."), size) for size in sizes]
        self.book.new(ids)
        if made:
            self.book.created([c for c, _ in ids])
            for chunk, size in ids:
                self.phase[chunk], self.size[chunk] = Phase.RESERVED, size
        else:
            self.book.not_created([c for c, _ in ids])

    @rule(made=st.booleans())
    def pin_for_the_pool(self, made):
        chunk = self._new_id("pool-")
        self.book.making(chunk)
        assert self.book.bytes_in(Phase.MAKING) == CHUNK
        if made:
            self.book.pooled_in(chunk)
            self.phase[chunk], self.size[chunk] = Phase.POOLED, CHUNK
            self.pool.append(chunk)
        else:
            self.book.not_made(chunk)

    @rule(count=st.integers(0, 3))
    def take_from_the_pool(self, count):
        taken = self.book.take_pool(count)
        assert taken == self.pool[:count]
        del self.pool[:count]
        for chunk in taken:
            self.phase[chunk] = Phase.RESERVED

    @rule()
    def give_back_a_pooled_chunk(self):
        chunk = self.book.pop_pool()
        assert chunk == (self.pool.pop() if self.pool else None)
        if chunk is not None:
            del self.phase[chunk], self.size[chunk]

    @rule(data=st.data())
    def keep_a_copy(self, data):
        reserved = self._in(Phase.RESERVED)
        if not reserved:
            return
        chunks = data.draw(st.lists(st.sampled_from(reserved), min_size=1, max_size=3, unique=True))
        allocation = self._new_id("alloc")
        self.book.keep_copy(allocation, chunks)
        self.copies[allocation] = chunks
        for chunk in chunks:
            self.phase[chunk] = Phase.COPY

    @rule(data=st.data())
    def discard(self, data):
        reserved = self._in(Phase.RESERVED)
        chunks = data.draw(st.lists(st.sampled_from(reserved), max_size=3, unique=True)) if reserved else []
        assert sorted(self.book.discard(chunks)) == sorted(chunks)
        for chunk in chunks:
            del self.phase[chunk], self.size[chunk]

    @rule(data=st.data(), lost=st.booleans())
    def release_a_copy(self, data, lost):
        if not self.copies:
            return
        allocation = data.draw(st.sampled_from(sorted(self.copies)))
        names = [name for name, _ in self.book.named_chunks(allocation)]
        chunks = self.copies.pop(allocation)
        assert [parse_chunk_name(name)[0] for name in names] == [allocation] * len(chunks)
        gone, told = self.book.release([allocation])
        assert gone == chunks and told == names
        for chunk in chunks:
            del self.phase[chunk], self.size[chunk]
        if lost:  # a copy that never came over: its release finds nothing
            self.book.mark_lost([allocation])
            assert self.book.release([allocation]) == ([], [])

    @rule(data=st.data())
    def a_move_out_of_turn_changes_nothing(self, data):
        chunk = data.draw(st.sampled_from(sorted(self.phase) or ["nowhere"]))
        before = copy.deepcopy(self.book)
        move = data.draw(st.sampled_from(["created", "pooled_in", "not_made", "keep"]))
        allowed = {"created": Phase.NEW, "pooled_in": Phase.MAKING, "not_made": Phase.MAKING,
                   "keep": Phase.RESERVED}[move]
        if self.phase.get(chunk) is allowed:
            return
        with pytest.raises(ChunkError):
            if move == "keep":
                self.book.keep_copy(self._new_id("alloc"), [chunk])
            else:
                getattr(self.book, move)(chunk if move != "created" else [chunk])
        assert self.book == before

    @invariant()
    def counts_are_the_chunks(self):
        book = getattr(self, "book", None)
        if book is None:
            return
        book.check()
        for phase in Phase:
            assert book.bytes_in(phase) == sum(self.size[c] for c in self._in(phase)), phase
        assert sorted(book.made()) == sorted(self.phase) and book.made_count() == len(self.phase)
        assert book.copies() == (len(self.copies), sum(self.size[c] for cs in self.copies.values() for c in cs))
        assert book.in_flight == sum(self.size[c] for c, p in self.phase.items() if p is not Phase.COPY)
        for allocation, chunks in self.copies.items():
            whole = len(chunks) == 1
            named = book.named_chunks(allocation)
            assert [chunk for _, chunk in named] == chunks
            if whole:
                assert named[0][0] == chunk_name(allocation, 0, self.size[chunks[0]], True) == allocation


def test_the_chunk_book_keeps_its_counts_through_any_moves():
    run_state_machine_as_test(ChunkBookMachine)
