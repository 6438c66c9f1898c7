"""`-o json` / `--output json` for every `kv` command that prints something.

A command prints one JSON document on one line, or, for a stream (scan, watch), one
document per line (NDJSON). Values appear as in the HTTP API: UTF-8 text, or base64 with
`"encoding": "base64"` when they are not text. Field names are documented in README.md
("Machine-readable output") and are part of the contract.
"""

from __future__ import annotations

import argparse
import os
import sys

import orjson

FORMATS = ("text", "json")


def silence_stdout() -> None:
    """The reader of stdout went away (kv scan | head): what is still printed goes nowhere,
    and nothing is left to fail at exit when Python flushes it."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def add_output_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-o", "--output", choices=FORMATS, default="text",
        help="text (default) or json: one JSON document, or one per line for streams",
    )


def wants_json(args: argparse.Namespace) -> bool:
    return getattr(args, "output", "text") == "json"


def emit(doc: object) -> None:
    """One JSON document on one line of standard output."""
    sys.stdout.buffer.write(orjson.dumps(doc) + b"\n")
    sys.stdout.flush()


def report(args: argparse.Namespace, doc: object, text: str) -> None:
    """Print `doc` as JSON with -o json, else the line `text`."""
    if wants_json(args):
        emit(doc)
    else:
        print(text, flush=True)


def listing_text(value: bytes) -> str:
    """A value (or a key's bytes) on one line of a tab-separated listing (kv scan, kv
    watch): bytes that are not UTF-8 as \\xNN, and control characters (NUL, tab, newline...)
    escaped the same way, so that it never breaks the line or writes raw control bytes to a
    terminal."""
    text = value.decode(errors="backslashreplace")
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode() for ch in text)
