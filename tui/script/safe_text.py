"""A script's output line as Rich Text that cannot drive the terminal dptui draws on.

The script writes for a terminal of its own; in dptui's log its bytes land inside dptui's
screen, where `ESC ] 0 ; title BEL` would retitle the window and `ESC [ 2 J` wipe the panels.
As a log viewer does (toolong, `less -R`): plain SGR colours stay colours, every other control
character is shown as text in caret notation (`^[]0;title^G`, `^[[2J`), as `cat -v` writes it.
"""

from __future__ import annotations

import re

from rich.style import Style
from rich.text import Text

# SGR: ESC [ params m, the colours and bold of coloured logs. Nothing else is passed on.
_SGR = re.compile(r"(\x1b\[[0-9;:]*m)")
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f\x80-\x9f]")  # every C0 but tab, DEL, C1


def _caret(match: re.Match[str]) -> str:
    code = ord(match.group())
    if code < 0x80:
        return "^" + chr(code ^ 0x40)  # ESC -> ^[, BEL -> ^G, DEL -> ^?
    return f"<U+{code:04X}>"  # C1 (CSI as one byte...): no caret form


def visible(line: str) -> str:
    """`line` with every control character but tab shown as text."""
    return _CONTROL.sub(_caret, line)


def safe_text(line: str, style: str | Style = "") -> Text:
    """`line` as Text: SGR colours kept, other control sequences shown as text."""
    if "\x1b" not in line:
        return Text(visible(line), style=style)
    # Rich decodes SGR itself: hand it the line with only the SGR sequences left raw
    # (split's odd parts are what the capturing group matched).
    parts = _SGR.split(line)
    kept = "".join(part if i % 2 else visible(part) for i, part in enumerate(parts))
    decoded = Text.from_ansi(kept, style=style)
    decoded.end = ""
    return decoded
