"""The `kv` command line (also `python -m kv`).

One module per command group, each with `add_parser(sub)` (which registers its commands and
sets `run` as their default) and `run(args)`; this module builds the parser from them and is
the one place that turns what a command raises into a one-line refusal."""

from __future__ import annotations

import argparse
import difflib
import importlib
import logging
import sys

from .output import silence_stdout
from .refusal import debug_wanted, describe
from .settings import serve_config

__all__ = ["build_parser", "main", "serve_config"]

# The command groups: kv/cli/<group>.py.
GROUPS = ("serve", "cluster", "data", "member", "snapshot", "bench", "spark", "lease")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line that says where to look, and an option is
    spelled in full: argparse would take `--endpoint` for `--endpoints`, and a script
    written so would break when a new option shares the prefix. Subcommands' parsers are
    of this class too (add_subparsers makes them of the parent's class)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message}; see {self.prog} --help\n")

    def parse_args(self, args=None, namespace=None):
        # argparse reports leftovers from the top parser ("kv: unrecognized arguments");
        # name the command they were given to instead.
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            prog = getattr(ns, "prog_name", self.prog)
            self.exit(2, f"{prog}: unrecognized arguments: {' '.join(extras)}{_did_you_mean(self, prog, extras)}; see {prog} --help\n")
        return ns


def _did_you_mean(root: argparse.ArgumentParser, prog: str, extras: list[str]) -> str:
    """`--endpoint`: did you mean --endpoints? (options are not abbreviated)."""
    parser = next((p for p in _all_parsers(root) if p.prog == prog), root)
    options = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    for word in extras:
        if word == "--":
            break  # what follows is not options
        name = word.partition("=")[0]
        if name.startswith("--"):
            close = [o for o in options if o.startswith(name)] or difflib.get_close_matches(name, options, n=1, cutoff=0.75)
            if close:
                return f" (did you mean {' or '.join(close[:3])}?)"
    return ""


def _option_before_the_command(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """`kv --endpoints URL get k`: a command's option given before the command. The
    refusal for it, or None."""
    if not argv or not argv[0].startswith("--"):
        return None
    name = argv[0].partition("=")[0]
    if any(name in a.option_strings for a in parser._actions):
        return None  # kv's own (--debug, --version, --help)
    having = [p.prog for p in _all_parsers(parser) if any(name in a.option_strings for a in p._actions)]
    if not having:
        return None  # no command has it: argparse says so
    words = [w for w in argv[1:] if not w.startswith("-")]
    typed = [p for p in having if _in_order(p.split()[1:], words)]  # the command given, if it takes it
    if not typed:
        return f"kv: {name} goes after a command that takes it: {', '.join(having)}"
    prog = max(typed, key=len)
    return f"kv: {name} goes after the command, as in {prog} {name} ...; see {prog} --help"


def _in_order(needles: list[str], words: list[str]) -> bool:
    it = iter(words)
    return all(n in it for n in needles)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    from .. import __version__

    try:
        v = version("ledgerkv")
    except PackageNotFoundError:
        v = __version__
    return f"kv (ledgerkv) {v}, Python {sys.version.split()[0]}"


def _all_parsers(p: argparse.ArgumentParser):
    yield p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in {id(s): s for s in action.choices.values()}.values():
                yield from _all_parsers(sub)


def _add_common_options(root: argparse.ArgumentParser) -> None:
    """--debug on every command (also before it), and the command's name for its errors."""
    root.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors (or KV_DEBUG=1)")
    for p in _all_parsers(root):
        if p is not root:
            p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        p.set_defaults(prog_name=p.prog)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kv", description="ledgerkv: a key-value store on a Raft replicated log.")
    p.add_argument("--version", action="version", version=_version())
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
    for group in GROUPS:  # in this order in `kv --help`
        importlib.import_module(f"{__name__}.{group}").add_parser(sub)
    _add_common_options(p)
    return p


# Commands that run another command: `kv lock NAME [options] -- COMMAND ARGS...`. What follows
# the first `--` is the command, whatever it looks like; argparse cannot mix options after a
# positional with a remainder, so it is cut off before parsing.
RUNS_A_COMMAND = ("lock",)


def _split_command(argv: list[str]) -> tuple[list[str], list[str] | None]:
    words = [a for a in argv if not a.startswith("-")]
    if "--" not in argv or not words or words[0] not in RUNS_A_COMMAND:
        return argv, None
    i = argv.index("--")
    return argv[:i], argv[i + 1 :]


def _client_notices_to_stderr(prog: str) -> None:
    """What a client says while it waits (no node listening, say) is a line on stderr, as
    a refusal is: every command that talks to a cluster (the data commands, snapshot save,
    spark) uses kv.Client."""
    notices = logging.StreamHandler(sys.stderr)
    notices.setFormatter(logging.Formatter(f"{prog}: %(message)s"))
    log = logging.getLogger("kv.client")
    log.handlers[:] = [notices]
    log.propagate = False


def main(argv: list[str] | None = None) -> int:
    """Run one command. Every refusal is one line on stderr and a non-zero exit status:
    commands raise, and this is the one place that turns what they raise into that line."""
    parser = build_parser()
    argv, command = _split_command(sys.argv[1:] if argv is None else list(argv))
    misplaced = _option_before_the_command(parser, argv)
    if misplaced is not None:
        print(misplaced, file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if command is not None:
        args.command = command
    if args.cmd is None:
        parser.print_help()
        return 2
    if args.cmd != "serve":  # kv serve routes every logger to its own log
        _client_notices_to_stderr(args.prog_name)
        # A lost lease is the command's to report, in its one line (kv lock, kv elect).
        logging.getLogger("kv.coordination").setLevel(logging.ERROR)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (kv scan | head): stop quietly, as Unix tools do
        silence_stdout()
        return 141  # 128 + SIGPIPE
    except Exception as e:
        if debug_wanted(args.debug):
            raise
        line, code = describe(e)
        print(f"{args.prog_name}: {line}", file=sys.stderr)
        return code
