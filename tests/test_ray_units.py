"""gms.ray's arithmetic and names, without Ray: requests, rounding, GPU names."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gms.ray.errors import GPUMemoryRequestError, NoGPUFitsError
from gms.ray.names import gpu_of, host_gpu, parse_gpu, resource_name
from gms.ray.units import EXACT_BYTES, UNIT_SCALING, parse_gpu_memory, round_to_gpu

GB, GiB = 10**9, 2**30


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (20 * GB, 20 * GB),
        ("20GB", 20 * GB),
        ("20GiB", 20 * GiB),
        ("20 gib", 20 * GiB),
        ("1.5GiB", 3 * GiB // 2),
        ("10MB", 10**7),
        ("512MiB", 512 << 20),
        ("300B", 300),
        ("300", 300),
        ("0.5B", 1),  # a fractional byte rounds up
        (2e10, 20 * GB),
    ],
)
def test_sizes_parse_to_bytes(text, expected):
    assert parse_gpu_memory(text) == expected


@pytest.mark.parametrize("bad", ["20G", "20 M", "GB", "1e9", "-1GB", "", 0, -5, "0MB", True, None, 1.5j, float("nan")])
def test_bad_sizes_are_value_errors(bad):
    with pytest.raises(ValueError, match="gpu_memory"):
        parse_gpu_memory(bad)


@pytest.mark.parametrize(
    ("asked", "capacity", "fraction", "scheduled"),
    [
        # The seed's examples: the same request is a different share of a 40 GB and an 80 GB GPU.
        (20 * GB, 40 * GB, 0.5, 20 * GB),
        (20 * GB, 80 * GB, 0.25, 20 * GB),
        (10 * GB, 40 * GB, 0.25, 10 * GB),
        (10 * GB, 80 * GB, 0.125, 10 * GB),
        # ... and its rounding: up to the next 1/10,000 of the GPU.
        (10**7, 40 * GB, 0.0003, 12 * 10**6),
        (10**7, 80 * GB, 0.0002, 16 * 10**6),
        (40 * GB, 40 * GB, 1.0, 40 * GB),
    ],
)
def test_rounding_follows_the_seed(asked, capacity, fraction, scheduled):
    rounded = round_to_gpu(asked, capacity)
    assert rounded.fraction == fraction
    assert rounded.scheduled_bytes == scheduled
    assert rounded.fits


def test_a_request_larger_than_the_gpu_does_not_fit():
    assert not round_to_gpu(40 * GB + 1, 40 * GB).fits


@given(
    capacity=st.integers(1, EXACT_BYTES),
    asks=st.lists(st.integers(1, 10**12), min_size=1, max_size=20),
)
def test_rounded_requests_hold_what_was_asked_and_never_overfill(capacity, asks):
    placed = 0
    for asked in asks:
        rounded = round_to_gpu(asked, capacity)
        assert rounded.scheduled_bytes >= asked
        assert rounded.units == -(-asked * UNIT_SCALING // capacity)  # the smallest share that holds it
        assert rounded.fits == (rounded.scheduled_bytes <= capacity)
        if rounded.fits and placed + rounded.units <= UNIT_SCALING:
            placed += rounded.units
    # Shares that add up to the whole GPU never book more bytes than it has.
    assert placed * capacity // UNIT_SCALING <= capacity


def test_exact_bytes_bound_is_where_doubles_stop_holding_units():
    # Ray converts a quantity with (int64)(double * 10000): exact while that product is.
    assert float(EXACT_BYTES * UNIT_SCALING) == EXACT_BYTES * UNIT_SCALING
    assert EXACT_BYTES * UNIT_SCALING <= 2**53 < (EXACT_BYTES + 1) * UNIT_SCALING
    assert EXACT_BYTES > 288 * GB  # above any GPU made so far


def test_gpu_names_round_trip():
    uuid = "GPU-2d2eca4f-b2f0-3cf9-15f6-e0e3cba13f08"
    assert gpu_of(resource_name(uuid)) == uuid
    assert parse_gpu(uuid).backend == "cuda" and parse_gpu(uuid).uuid == uuid
    host = host_gpu(3, "/run/gms", hostname="node-a")
    assert parse_gpu(host).backend == "host" and parse_gpu(host).device == 3
    assert gpu_of("CPU") is None and gpu_of("gms_gpu_memory_") is None


def test_host_gpu_names_differ_by_node_and_socket_folder():
    names = {
        host_gpu(0, "/run/gms", hostname="a"),
        host_gpu(0, "/run/gms", hostname="b"),
        host_gpu(0, "/run/other", hostname="a"),
        host_gpu(1, "/run/gms", hostname="a"),
    }
    assert len(names) == 4
    assert host_gpu(0, "/run/gms", hostname="a") == host_gpu(0, "/run/gms/", hostname="a")


def test_no_fit_error_survives_pickling():
    err = pickle.loads(pickle.dumps(NoGPUFitsError("too big", 5, 4)))
    assert isinstance(err, GPUMemoryRequestError) and isinstance(err, ValueError)
    assert (str(err), err.asked_bytes, err.largest_bytes) == ("too big", 5, 4)


# -- picks Ray's books do not show yet (placement._RecentPicks) ---------------------


def test_a_pick_counts_until_rays_books_show_it():
    from gms.ray.placement import _RecentPicks

    recent = _RecentPicks()
    recent.add("a", 20, ray_available=40)
    recent.add("a", 10, ray_available=40)
    assert recent.pending({"a": 40}) == {"a": 30}  # Ray shows neither yet
    assert recent.pending({"a": 20}) == {"a": 10}  # the first is booked: never counted twice
    assert recent.pending({"a": 20}) == {"a": 10}
    recent.add("a", 5, ray_available=20)  # made against a count that already showed the first
    assert recent.pending({"a": 10}) == {"a": 5}
    assert recent.pending({"a": 5}) == {}


def test_a_release_in_between_keeps_the_pick_counted():
    from gms.ray.placement import _RecentPicks

    recent = _RecentPicks()
    recent.add("a", 20, ray_available=20)
    assert recent.pending({"a": 30}) == {"a": 20}  # 10 came back: the pick is not seen in that
    assert recent.pending({"a": 10}) == {}  # now it is


def test_a_pick_ray_never_shows_is_forgotten(monkeypatch):
    from gms.ray import placement

    recent = placement._RecentPicks()
    recent.add("a", 20, ray_available=40)
    recent.add("b", 5, ray_available=8)
    monkeypatch.setattr(placement, "PENDING_S", 0.0)
    assert recent.pending({"a": 40, "b": 8}) == {}
