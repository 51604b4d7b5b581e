"""Ports a launcher picks before the role binds them: outside the kernel's ephemeral range,
free, and not handed out twice on one host while reserved."""

from __future__ import annotations

import socket

import pytest

from rlfleet.common import ports


@pytest.fixture
def own_reservations(tmp_path, monkeypatch):
    """A reservation file of this test's own, so other tests' picks do not interfere."""
    path = tmp_path / "ports"
    monkeypatch.setattr(ports, "_reservation_file", lambda: path)
    return path


def test_a_picked_port_is_free_and_below_the_ephemeral_range(own_reservations):
    port = ports.free_port()
    assert ports.WINDOW_LOW <= port < ports.ephemeral_low()
    assert port != ports.RESERVED_PORT
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))  # nobody had it


def test_picks_are_not_repeated_while_reserved(own_reservations, monkeypatch):
    # a window of 1,100 ports: 300 random picks would repeat one with near certainty
    monkeypatch.setattr(ports, "ephemeral_low", lambda: ports.WINDOW_LOW + 1100)
    picked = [ports.free_port() for _ in range(300)]
    assert len(set(picked)) == 300
    assert len(own_reservations.read_text().splitlines()) == 300


def test_old_reservations_expire(own_reservations, monkeypatch):
    own_reservations.write_text("21000 100\n21001 notatime\ngarbage\n")
    monkeypatch.setattr(ports, "ephemeral_low", lambda: ports.WINDOW_LOW + 1100)
    ports.free_port()
    kept = own_reservations.read_text().splitlines()
    assert len(kept) == 1 and not kept[0].startswith("21000")


def test_a_port_in_use_is_not_free(own_reservations, monkeypatch):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        taken = sock.getsockname()[1]
        sock.listen()
        assert not ports.is_free(taken)


def test_an_odd_ephemeral_range_falls_back_to_the_kernel(own_reservations, monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_low", lambda: 1024)
    port = ports.free_port()
    assert port > 0 and not own_reservations.exists()
