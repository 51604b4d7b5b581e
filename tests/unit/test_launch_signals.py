"""`rlfleet up`'s launchers stop on SIGTERM and SIGINT, even when started with SIGINT ignored."""

import os
import signal

import pytest

from rlfleet.launch.session import stop_on_signals


@pytest.fixture
def sigint_ignored():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_in_the_block_interrupts_it(sigint_ignored, signum):
    with pytest.raises(KeyboardInterrupt), stop_on_signals():
        os.kill(os.getpid(), signum)
        pytest.fail("the signal did not interrupt the block")


def test_the_previous_handlers_come_back(sigint_ignored):
    before_term = signal.getsignal(signal.SIGTERM)
    with stop_on_signals():
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    assert signal.getsignal(signal.SIGTERM) is before_term
