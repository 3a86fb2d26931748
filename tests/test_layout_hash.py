"""The layout hash depends on structure only: never on ids or slot gaps."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gms.fsm import Allocation, MetadataEntry, compute_layout_hash

from .model_based.reference import reference_hash

layouts = st.lists(
    st.tuples(st.integers(1, 1 << 40), st.sampled_from(["weights", "kv_cache", "x"])),
    min_size=1,
    max_size=6,
).flatmap(
    lambda allocs: st.tuples(
        st.just(allocs),
        st.dictionaries(
            st.text(min_size=1, max_size=5),
            st.tuples(st.integers(0, len(allocs) - 1), st.integers(0, 100), st.binary(max_size=8)),
            max_size=5,
        ),
    )
)


def build(layout, id_prefix, slot_gap):
    allocs, meta = layout
    allocations = [
        Allocation(f"{id_prefix}{i}", size, size + 7, tag, i * slot_gap)
        for i, (size, tag) in enumerate(allocs)
    ]
    entries = [
        MetadataEntry(key, allocations[rank].allocation_id, offset, value)
        for key, (rank, offset, value) in meta.items()
    ]
    return allocations, entries


@given(layouts, st.integers(1, 5))
def test_same_structure_same_hash_whatever_the_ids(layout, gap):
    a = compute_layout_hash(*build(layout, "first-", 1))
    allocations, entries = build(layout, "second-", gap)
    b = compute_layout_hash(reversed(allocations), reversed(entries))
    assert a == b


@given(layouts)
def test_matches_the_documented_encoding(layout):
    allocations, entries = build(layout, "id", 1)
    allocs = {a.allocation_id: (a.size, a.aligned_size, a.tag, a.layout_slot) for a in allocations}
    meta = {m.key: (m.allocation_id, m.offset_bytes, m.value) for m in entries}
    assert compute_layout_hash(allocations, entries) == reference_hash(allocs, meta)


@given(layouts, st.data())
def test_any_structural_change_changes_the_hash(layout, data):
    allocations, entries = build(layout, "id", 1)
    before = compute_layout_hash(allocations, entries)
    i = data.draw(st.integers(0, len(allocations) - 1))
    a = allocations[i]
    change = data.draw(st.sampled_from(["size", "aligned", "tag", "order", "meta"]))
    if change == "size":
        allocations[i] = Allocation(a.allocation_id, a.size + 1, a.aligned_size, a.tag, a.layout_slot)
    elif change == "aligned":
        allocations[i] = Allocation(a.allocation_id, a.size, a.aligned_size + 1, a.tag, a.layout_slot)
    elif change == "tag":
        allocations[i] = Allocation(a.allocation_id, a.size, a.aligned_size, a.tag + "!", a.layout_slot)
    elif change == "order":
        if len(allocations) < 2 or allocations[0].size == allocations[-1].size:
            return
        first, last = allocations[0], allocations[-1]
        allocations[0] = Allocation(first.allocation_id, first.size, first.aligned_size, first.tag, last.layout_slot)
        allocations[-1] = Allocation(last.allocation_id, last.size, last.aligned_size, last.tag, first.layout_slot)
        entries = []  # compare bare allocation order
        before = compute_layout_hash(build(layout, "id", 1)[0], [])
    else:
        entries = entries + [MetadataEntry("\x00new", a.allocation_id, 0, b"")]
    assert compute_layout_hash(allocations, entries) != before
