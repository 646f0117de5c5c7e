"""The script's stdin when dptui owns the terminal: a terminal that has a size and never has input.

Scripts ask their stdin for the terminal's size: kuangliu/pytorch-cifar's widely copied
`progress_bar` runs `stty size` at import, which fails on /dev/null and ends the script before
its first line of training. A pseudo-terminal answers that ioctl. Its line discipline is
non-canonical with VMIN=0 and VTIME=0, so a read returns at once with nothing: `input()` and
`sys.stdin.read()` see end of file, as on an empty stdin. Nothing ever writes to it (the keys
are dptui's). The script does not take it as its controlling terminal: it inherits the
descriptor and never opens the device.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import struct
import termios


class QuietTty:
    """A pty pair: `stdin` goes to the child, `close()` once the child has ended."""

    def __init__(self) -> None:
        self._master, self.stdin = os.openpty()
        try:
            size = shutil.get_terminal_size()  # dptui's own terminal, else $COLUMNS/$LINES, else 80x24
            fcntl.ioctl(self.stdin, termios.TIOCSWINSZ, struct.pack("HHHH", size.lines, size.columns, 0, 0))
            attrs = termios.tcgetattr(self.stdin)
            attrs[3] &= ~(termios.ICANON | termios.ECHO)  # lflag: no line editing, no echo
            attrs[6][termios.VMIN] = 0
            attrs[6][termios.VTIME] = 0
            termios.tcsetattr(self.stdin, termios.TCSANOW, attrs)
        except (OSError, termios.error):
            self.close()
            raise OSError("the pseudo-terminal could not be set up") from None

    @classmethod
    def open(cls) -> QuietTty | None:
        """One, or None where no pseudo-terminal can be had (no /dev/pts): then an empty stdin."""
        try:
            return cls()
        except OSError:
            return None

    def child_started(self) -> None:
        """The child holds its end now: ours would only keep the terminal open."""
        if self.stdin >= 0:
            os.close(self.stdin)
            self.stdin = -1

    def close(self) -> None:
        self.child_started()
        if self._master >= 0:
            os.close(self._master)
            self._master = -1
