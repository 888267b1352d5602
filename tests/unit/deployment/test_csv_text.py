"""Unit: the CSV text checks batch scoring runs before Spark starts (`pipeline.deployment.csv_text`): UTF-8 and
quoting, on any split of the file into chunks. What Spark itself makes of the same files is checked beside the
Spark job (`test_batch_scoring.test_spark_reads_an_open_quote_as_the_rest_of_the_file`)."""

from __future__ import annotations

import csv
import gzip
import io

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.deployment import batch_inputs
from pipeline.deployment.csv_text import QuoteState, check_csv_text

#: CSV texts, with the line of the quote left open, or None: as Spark reads them (`spark_io.CSV_READ`; checked
#: against Spark in `test_batch_scoring`).
CASES = {
    "open quote in the text": ('id,text\nr1,"abc\nr2,def\nr3,ghi\n', 2),
    "open quote in the id": ('id,text\n"r1\nr2,ok\n', 2),
    "quote after a space (text)": ('id,text\nr1, "abc,x\nr2,def\n', None),
    "quote inside a field (text)": ('id,text\nr1,ab"c\nr2,def\n', None),
    "text after the closing quote": ('id,text\nr1,"abc"def\nr2,ok\n', None),
    "a quote after the closing quote": ('id,text\nr1,"abc"d"ef\nr2,ok\n', None),
    "a space and a quote after it": ('id,text\nr1,"abc" "d\nr2,ok\n', None),
    "doubled quote and a newline, closed": ('id,text\nr1,"a""b\nc"\nr2,ok\n', None),
    "closed, then spaces": ('id,text\nr1,"abc"  \nr2,ok\n', None),
    "closed by the last character": ('id,text\nr1,"a"""', None),
    "open after a doubled quote": ('id,text\nr1,ok\nr2,"a""\n', 3),
    "CRLF lines, open on the third": ('id,text\r\nr1,ok\r\nr2,"never\r\nr3,x\r\n', 3),
}


def state_after(text: str, cuts: list[int]) -> QuoteState:
    state, start = QuoteState(), 0
    for cut in [*sorted(cuts), len(text)]:
        state.feed(text[start:cut])
        start = max(start, cut)
    return state


@pytest.mark.parametrize("name", list(CASES))
def test_an_open_quote_is_found_on_its_line_however_the_text_is_cut(name):
    text, line = CASES[name]
    assert state_after(text, []).open_since == line
    assert state_after(text, list(range(len(text)))).open_since == line  # a character at a time


@settings(max_examples=150, deadline=None)
@given(rows=st.lists(st.lists(st.text(alphabet='ab ,"\n\r\u00e9', max_size=8), min_size=2, max_size=2), max_size=6),
       cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=6), tail=st.text(alphabet='ab,\n', max_size=6))
def test_written_csv_never_counts_as_open_and_an_unclosed_last_field_always_does(rows, cuts, tail):
    """Whatever a CSV writer quotes (quotes, separators, newlines in fields) closes; a last field that opens a quote
    and never closes it is found on the line it opened on."""
    out = io.StringIO(newline="")
    csv.writer(out, lineterminator="\n").writerows([["id", "text"], *rows])
    written = out.getvalue()
    assert state_after(written, cuts).open_since is None
    opened_on = written.count("\n") + 1
    assert state_after(written + 'r9,"' + tail.replace('"', ""), cuts).open_since == opened_on


def test_a_file_ending_inside_quotes_is_refused_naming_the_line_plain_or_compressed(tmp_path):
    plain, packed = tmp_path / "reviews.csv", tmp_path / "more.csv.gz"
    plain.write_text(CASES["open quote in the text"][0])
    with gzip.open(packed, "wt", encoding="utf-8") as f:
        f.write("id,text\nr1,fine\n" + CASES["open quote in the text"][0].split("\n", 1)[1])
    with pytest.raises(ValueError, match=r'opens on line 2 never closes.*rest of the file \(3 line'):
        batch_inputs.check_input(str(plain), "csv")
    with pytest.raises(ValueError, match=r"more\.csv\.gz: the quoted field that opens on line 3"):
        batch_inputs.check_input(str(packed), "csv")
    fine = tmp_path / "fine.csv"
    fine.write_text(CASES["doubled quote and a newline, closed"][0])
    batch_inputs.check_input(str(fine), "csv")


def test_the_utf8_offset_is_exact_across_chunks(tmp_path):
    split = tmp_path / "split.csv"
    split.write_bytes(b"a" * 15 + b"\xc3(" + b"b" * 20)
    with pytest.raises(ValueError, match=r"\(byte 15: "):
        check_csv_text(split, chunk_bytes=16)


def test_quotes_are_followed_across_read_chunks(tmp_path):
    path = tmp_path / "reviews.csv"
    path.write_text('id,text\nr1,"a ""long"" one, with\nlines"\nr2,"open\n' + "r3,x\n" * 50)
    for chunk_bytes in (1, 2, 3, 7, 1 << 20):
        with pytest.raises(ValueError, match="opens on line 4 never closes"):
            check_csv_text(path, chunk_bytes=chunk_bytes)
