"""How a wrong command line is reported: one line that names what is wrong, the nearest right spelling where
there is one, and where the help is; exit status 2. (argparse's own report is its whole usage, seven lines
for `pffs mount`, then the error, and no suggestion.)

    pffs: error: unrecognized arguments: --endpont-url (did you mean --endpoint-url?); see pffs mount --help
"""

from __future__ import annotations

import argparse
import ast
import difflib
import re
import sys
from collections.abc import Sequence
from typing import NoReturn

from pffs.cli.errors import EXIT_USAGE

_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")
_CHOICE = re.compile(
    r"^argument (?P<argument>\S+): invalid choice: (?P<value>.+?) \(choose from (?P<choices>.*)\)$"
)


class _Wrong(Exception):
    """A mistake argparse found, and the (sub)parser that found it: reported by the outermost parse."""

    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser, self.message = parser, message


class CommandLineParser(argparse.ArgumentParser):
    """An ArgumentParser that reports a mistake in one line (its subcommands' parsers are of its class)."""

    _parsing = False  # a parse_args of this class is under way: mistakes go up to it

    def error(self, message: str) -> NoReturn:
        if CommandLineParser._parsing:
            raise _Wrong(self, message)
        self.exit(EXIT_USAGE, f"pffs: error: {message}; see {self.prog} --help\n")

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        argv = list(sys.argv[1:] if args is None else args)
        outermost = not CommandLineParser._parsing
        CommandLineParser._parsing = True
        try:
            parsed, extras = self.parse_known_args(argv, namespace)
            if extras:
                chosen = chosen_parser(self, parsed)
                raise _Wrong(chosen, unrecognized(_option_strings(chosen), extras))
        except _Wrong as wrong:
            if not outermost:
                raise
            self.exit(EXIT_USAGE, f"pffs: error: {explain(self, wrong.parser, wrong.message, argv)}\n")
        finally:
            if outermost:
                CommandLineParser._parsing = False
        return parsed


def chosen_parser(parser: argparse.ArgumentParser, parsed: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub)subcommand the command line chose: `pffs cache gc` -> gc's."""
    while True:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                name = getattr(parsed, action.dest, None)
                if name in action.choices:
                    parser = action.choices[name]
                    break
        else:
            return parser


def unrecognized(options: set[str], words: Sequence[str]) -> str:
    """'unrecognized arguments: --endpont-url (did you mean --endpoint-url?)': each option with the nearest
    of `options`, if one is near. Only the options, if there are any: the other words left over are most
    likely the values of those (`--endpont-url URL SOURCE MOUNTPOINT` takes URL for SOURCE, and leaves
    MOUNTPOINT over)."""
    options_given = [word for word in words if word[:1] == "-" and len(word) > 1]
    hints = []
    for word in options_given or words:
        name = word.split("=", 1)[0] if word.startswith("--") else word
        close = difflib.get_close_matches(name, sorted(options), n=1, cutoff=0.75) if word[:1] == "-" else []
        hints.append(name + (f" (did you mean {close[0]}?)" if close else ""))
    return f"unrecognized arguments: {' '.join(hints)}"


def explain(
    top: argparse.ArgumentParser, parser: argparse.ArgumentParser, message: str, argv: Sequence[str]
) -> str:
    """One line for what argparse found wrong, with the nearest right spelling. An option no command knows
    comes first, whatever argparse then tripped on: misspelled before the command, argparse takes its value
    for the command ("invalid choice: 'http://...'")."""
    known = _every_option_string(top)
    unknown = [word for word in _option_words(argv) if not _known(word, known)]
    if unknown and not message.startswith("unrecognized arguments:"):
        message = unrecognized(known, unknown)
    elif found := _CHOICE.match(message):
        choices = re.findall(r"'([^']*)'", found["choices"])
        try:
            value = str(ast.literal_eval(found["value"]))
        except (ValueError, SyntaxError):
            value = found["value"]
        close = difflib.get_close_matches(value, choices, n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}?" if close else f"choose from {', '.join(choices)}"
        argument = found["argument"]
        if argument.isupper():  # a subcommand: COMMAND, ACTION
            message = f"unknown {argument.lower()} {value!r} ({hint})"
        else:
            message = f"argument {argument}: invalid choice: {value!r} ({hint})"
    return f"{message}; see {parser.prog} --help"


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


def _every_option_string(parser: argparse.ArgumentParser) -> set[str]:
    """The options of `parser` and of all its subcommands."""
    found = _option_strings(parser)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _every_option_string(sub)
    return found


def _option_words(argv: Sequence[str]) -> list[str]:
    words = []
    for word in argv:
        if word == "--":
            break
        if word.startswith("-") and len(word) > 1 and not _NUMBER.match(word):
            words.append(word)
    return words


def _known(word: str, options: set[str]) -> bool:
    name = word.split("=", 1)[0]
    if name in options:
        return True
    if name.startswith("--"):  # argparse takes a unique prefix of a long option
        return any(o.startswith(name) for o in options)
    return name[:2] in options  # -vv, -d1: short options run together or with their value
