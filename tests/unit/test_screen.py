"""`rlfleet up`'s output pump: a role's progress bar and log lines never run into each other,
on a terminal (the bar redrawn in place under the lines) or in a file (a line per redraw)."""

import io
import sys
import textwrap
import time

from rlfleet.launch import process, screen
from rlfleet.launch.process import RoleProcess, _pieces
from rlfleet.launch.screen import WIPE, Screen


class Chunks:
    """A pipe that returns the given chunks, one per read."""

    def __init__(self, *chunks: bytes) -> None:
        self.chunks = list(chunks)

    def read1(self, _size: int) -> bytes:
        return self.chunks.pop(0) if self.chunks else b""


class Terminal(io.TextIOWrapper):
    def __init__(self, tty: bool) -> None:
        super().__init__(io.BytesIO())
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty

    def written(self) -> bytes:
        self.flush()
        return self.buffer.getvalue()


def test_pieces_split_lines_and_redraws_and_show_a_redraw_at_once():
    stream = Chunks(b"start\n\rsteps 1/2", b"\rsteps 2/2\n", b"tail")
    assert list(_pieces(stream)) == [
        (b"start", b"\n"),
        (b"", b"\r"),
        (b"steps 1/2", b""),  # drawn now, not when the next redraw comes
        (b"steps 1/2", b"\r"),
        (b"steps 2/2", b"\n"),
        (b"tail", b"\n"),
    ]


def test_on_a_terminal_a_line_goes_above_the_bar_and_the_bar_is_drawn_again(monkeypatch):
    out = Terminal(tty=True)
    monkeypatch.setattr(sys, "stdout", out)
    shown = Screen()
    shown.bar("trainer", b"[trainer] 1/2", finished=False)
    shown.line("rollout-0", b"[rollout-0] hello\n")
    shown.line("trainer", b"[trainer] 2/2\n")  # the bar closed: its last state stays
    shown.line("router", b"[router] bye\n")
    assert out.written() == (
        WIPE
        + b"[trainer] 1/2"
        + WIPE
        + b"[rollout-0] hello\n"
        + WIPE
        + b"[trainer] 1/2"
        + WIPE
        + b"[trainer] 2/2\n"
        + b"[router] bye\n"
    )


def test_elsewhere_each_finished_redraw_is_a_line(monkeypatch):
    out = Terminal(tty=False)
    monkeypatch.setattr(sys, "stdout", out)
    shown = Screen()
    shown.bar("trainer", b"[trainer] 1/2", finished=False)
    shown.bar("trainer", b"[trainer] 1/2", finished=True)
    shown.line("rollout-0", b"[rollout-0] hello\n")
    assert out.written() == b"[trainer] 1/2\n[rollout-0] hello\n"


ROLE = textwrap.dedent(
    """
    import logging, sys
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm
    logging.basicConfig(level="INFO", format="%(message)s", stream=sys.stderr)
    bar = tqdm(total=3, desc="steps", mininterval=0)
    with logging_redirect_tqdm():
        for step in range(3):
            bar.update(1)
            logging.info("step %d done", step)
    bar.close()
    """
)


def test_a_role_logging_under_its_bar_gives_whole_lines(tmp_path, monkeypatch):
    out = Terminal(tty=False)
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(process, "SCREEN", screen.Screen())
    env = {"PYTHONUNBUFFERED": "1"}
    child = RoleProcess("trainer", [sys.executable, "-c", ROLE], env, tmp_path / "trainer.log")
    child.start()
    assert child.proc.wait(60) == 0
    deadline = time.monotonic() + 10
    while not closed(out.written()) and time.monotonic() < deadline:  # the pump lags the exit
        time.sleep(0.05)
    lines = out.written().decode().splitlines()
    assert [line for line in lines if "done" in line] == [
        f"[trainer] step {i} done" for i in range(3)
    ]
    assert all(line.startswith("[trainer] ") and line.strip() != "[trainer]" for line in lines)
    assert any("3/3" in line for line in lines)
    logged = (tmp_path / "trainer.log").read_text().splitlines()
    assert [line for line in logged if "done" in line] == [f"step {i} done" for i in range(3)]


def closed(written: bytes) -> bool:
    """The bar's last line (written when it closes, after every log line) has come through."""
    return written.endswith(b"\n") and b"3/3" in written.splitlines()[-1]
