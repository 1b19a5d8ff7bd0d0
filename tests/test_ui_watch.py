"""What the page shows of user-written text, and the session a browser sends back."""

import re

import pytest

from anima_ui.ui.watch import plain, read_session


@pytest.mark.parametrize("text", [
    '<img src="/x.png" width="1200"> **loud** _quiet_ [a link](http://example.com) $$x^2$$ # title',
    "a & b; c \\ d `code` ~~gone~~ | table | > quote",
    "http://example.com/path www.example.com",
])
def test_plain_leaves_no_markup(text):
    escaped = plain(text)
    assert "<" not in escaped and ">" not in escaped  # no HTML tag can open
    # Every ASCII punctuation mark is backslash-escaped, except the & and ; of the HTML entities.
    unescaped = re.findall(r"(?<!\\)[!-%'-/:<-@\[-`{-~]", re.sub(r"\\.", "", escaped))
    assert unescaped == []


def test_plain_keeps_the_text_on_one_line():
    assert plain("two\nlines") == "two lines"


@pytest.mark.parametrize("value", [
    None, {"jobs": ["0123456789ab"], "ab": None, "last_seed": 7},
    {"jobs": [], "ab": {"off": {"job": "a"}, "on": {"item": "b"}}, "last_seed": None}, {},
])
def test_a_session_the_page_writes_is_read_back(value):
    session, readable = read_session(value)
    assert readable and session["jobs"] == (value or {}).get("jobs", [])


@pytest.mark.parametrize("value", [
    5, "jobs", [1], {"jobs": 5}, {"jobs": "0123456789ab"}, {"jobs": [[1]]}, {"jobs": ["a", "b", "c"]},
    {"ab": "x"}, {"ab": {"off": 1, "on": {"job": 2}}}, {"ab": {"off": {"job": "a"}}}, {"last_seed": True},
    {"last_seed": "7"},
])
def test_anything_else_reads_as_an_empty_unreadable_session(value):
    assert read_session(value) == ({"jobs": [], "ab": None, "last_seed": None}, False)
