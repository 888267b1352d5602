"""The typed command-line options several stages share, each with one help text (`stages/<name>.py` signatures)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

Finetuned = Annotated[Path, typer.Option(help="the finetuned model (HF format)")]
Tokenized = Annotated[Path, typer.Option(help="the tokenized splits (data/tokenized)")]
VariantsDir = Annotated[Path, typer.Option(help="the variants, one per DIR/<name> (read and written)")]
Metrics = Annotated[Path, typer.Option(help="the stage's metrics file (metrics/<stage>.json)")]
Plots = Annotated[Path, typer.Option(help="where the training curves go (CSV for `dvc plots`)")]
