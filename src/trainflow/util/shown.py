"""Text from a received file as it is shown: a run name, a folder name or a ledger field may hold a newline, a
terminal escape or a right-to-left override, and printed raw it would forge a line, clear a screen or reorder what a
reader sees. Everything trainflow prints, writes into report.md/compare.md or draws, and took from a file or a folder
name, goes through `shown`; a command line offered to paste goes through `shell_quoted`."""

from __future__ import annotations

import shlex
import unicodedata

# Formatting characters that reorder or hide text (bidirectional overrides and isolates, marks): category Cf holds
# them beside harmless ones (a soft hyphen), so they are named.
_REORDERING = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def _escaped(ch: str) -> str:
    if ch in "\n\r\t":
        return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}[ch]
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def shown(text: object) -> str:
    """`text` (str() of it) with control characters, line and paragraph separators and reordering marks escaped as
    \\n, \\x1b, \\u202e: one line, as it is, whatever a file put in it."""
    value = str(text)
    if value.isprintable():
        return value
    return "".join(_escaped(ch) if unicodedata.category(ch) in ("Cc", "Zl", "Zp") or ch in _REORDERING else ch
                   for ch in value)


def shell_quoted(*words: object) -> str:
    """Words as a shell reads them back (quoted where they hold spaces or shell characters), then shown()."""
    return shown(shlex.join(str(w) for w in words))
