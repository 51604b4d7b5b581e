"""The launcher's standard output, shared by the output pumps of every role it started.

Why one owner: several threads (one per role) write to the same terminal, and the trainer's
progress bar redraws its line in place (text ended by ``\\r``). Written as they come, a log
line of another role would land in the middle of the bar, and the bar would then be drawn
over it. On a terminal the bar therefore lives on the bottom row: a line from any role first
wipes that row, is printed, and the bar is drawn again below it. Anywhere else (a file, a
pipe, Ray's log forwarding) there is no row to keep: each finished redraw is a line of its
own, as in the role's log file.
"""

from __future__ import annotations

import shutil
import sys
import threading

WIPE = b"\r\x1b[K"  # back to column 0, erase to the end of the row


class Screen:
    """Lines and one live progress bar on our stdout (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bar = b""  # the bar drawn on the bottom row now (a terminal only); b"" = none
        self._owner = ""  # the role whose bar it is

    def line(self, owner: str, text: bytes) -> None:
        """A finished line (``text`` ends with a newline); a line of the bar's own role ends
        its bar (tqdm writes one when the bar closes, or breaks a line into it)."""
        with self._lock:
            wipe = WIPE if self._bar else b""
            if owner == self._owner:
                self._bar, self._owner = b"", ""
            self._write(wipe + text + self._bar)

    def bar(self, owner: str, text: bytes, finished: bool) -> None:
        """A redraw of ``owner``'s bar: ``finished`` when the next redraw has begun, else the
        redraw so far (drawn at once on a terminal, so the bar never lags a step behind)."""
        with self._lock:
            if not _is_terminal():
                if finished:
                    self._write(text + b"\n")
                return
            self._bar, self._owner = WIPE + _fit(text), owner
            self._write(self._bar)

    @staticmethod
    def _write(data: bytes) -> None:
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()


def _is_terminal() -> bool:
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):  # replaced or closed
        return False


def _fit(text: bytes) -> bytes:
    """``text`` cut to the terminal's width: a bar that wrapped could not be redrawn in place."""
    width = shutil.get_terminal_size().columns - 1
    return text.decode(errors="replace")[:width].encode()


SCREEN = Screen()
"""The one ``Screen`` of this process: every role's pump writes through it."""
