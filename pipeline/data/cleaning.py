"""How a review is cleaned before tokenization, in training and at inference alike: the `<br />` markup IMDB
reviews carry is dropped and whitespace collapsed. Standard library only: the request contract's checks
(`pipeline.deployment.protocol`) use it too, and Spark ships them to its executors by value."""

from __future__ import annotations

import re

#: The line-break markup of IMDB reviews (`<br />`, `<br/>`, `<br>`, any case).
LINE_BREAK_TAG = re.compile(r"<br\s*/?>", flags=re.IGNORECASE)
_SPACES = re.compile(r"\s+")


def clean_text(text: str) -> str:
    """Drop the `<br />` markup IMDB reviews carry and collapse whitespace."""
    return _SPACES.sub(" ", LINE_BREAK_TAG.sub(" ", text)).strip()
