"""What a local CSV input's text must be for Spark to read it as it was written, checked before Spark starts: UTF-8
(Spark scores the bytes it cannot decode as U+FFFD), and no quoted field left open (Spark's multi-line reader,
`spark_io.CSV_READ`, reads everything after a quote that never closes, the rest of the file, as that one field: the
reviews below it are scored as part of one review, silently). One pass over the file in chunks, so of any size."""

from __future__ import annotations

import codecs
import re
from collections.abc import Callable
from pathlib import Path
from typing import IO

#: The characters that move the quoting state: a quote, the field separator and the record separator.
_SPECIAL = re.compile(r'[",\n]')


class QuoteState:
    """RFC 4180 quoting as Spark reads it (`CSV_READ`: `"` quotes a field that begins with it, `""` inside one is a
    quote; a quote anywhere else is text), fed the decoded text in pieces of any size: `open_since` is the line
    where a quoted field opened and has not closed yet, or None."""

    def __init__(self) -> None:
        self.chars = 0  # the text fed so far, in characters
        self.field_start = 0  # where the field being read begins
        self.line = 1
        self.quoted_since: int | None = None  # the line a quoted field opened on, while inside it
        self.quote_at: int | None = None  # a quote inside a quoted field: its end, or the first of `""`
        self.ends_line = False  # whether the text fed so far ends with a record separator

    def feed(self, text: str) -> None:
        for match in _SPECIAL.finditer(text):
            at, char = self.chars + match.start(), match.group()
            if self.quote_at is not None:
                adjacent, self.quote_at = at == self.quote_at + 1, None
                if char == '"' and adjacent:
                    continue  # `""`: a quote in the field, which stays open
                self.quoted_since = None  # the quote closed the field; this character is outside it
            if self.quoted_since is not None:
                if char == '"':
                    self.quote_at = at
                elif char == "\n":
                    self.line += 1
                continue
            if char == '"':
                if at == self.field_start:
                    self.quoted_since = self.line
            else:
                self.field_start = at + 1
                self.line += char == "\n"
        self.chars += len(text)
        self.ends_line = text.endswith("\n") if text else self.ends_line

    @property
    def open_since(self) -> int | None:
        return self.quoted_since if self.quote_at is None else None


def check_csv_text(file: Path, chunk_bytes: int = 1 << 20, opener: Callable[..., IO[bytes]] | None = None) -> None:
    """`ValueError` where `file` (decompressed by `opener`, e.g. `gzip.open`, where given) is not UTF-8 (naming the
    byte offset) or ends inside a quoted field (naming the line it opened on)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    quotes = QuoteState()
    offset = 0
    with (opener or open)(file, "rb") as f:
        while True:
            chunk = f.read(chunk_bytes)
            pending = len(decoder.getstate()[0])  # the previous chunk's unfinished character starts this far back
            try:
                quotes.feed(decoder.decode(chunk, final=not chunk))
            except UnicodeDecodeError as exc:
                raise ValueError(f"{file} is not UTF-8 (byte {offset - pending + exc.start}: {exc.reason}): save it "
                                 "as UTF-8 (Spark would score the bytes it cannot read as U+FFFD)") from None
            if not chunk:
                break
            offset += len(chunk)
    if quotes.open_since is not None:
        lines = quotes.line - quotes.open_since + (0 if quotes.ends_line else 1)
        raise ValueError(f"{file}: the quoted field that opens on line {quotes.open_since} never closes, so Spark "
                         f"would read the rest of the file ({lines} line(s)) as that one field, and the rows in it "
                         "would not be scored as rows: close the quote (a quote inside a quoted field is written "
                         'twice, "")')
