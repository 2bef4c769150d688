"""Shell completion for ``rtrl`` and ``kubectl rtrl``, computed from their argparse parsers,
so that a new subcommand or flag completes without a script to keep in step.

- ``rtrl completion bash`` (or ``zsh``) prints a script for the shell's startup file; the
  script asks ``rtrl __complete WORD...`` for what may follow the words typed so far.
- ``kubectl rtrl``: kubectl (1.26 and later) completes a plugin's arguments by running
  ``kubectl_complete-rtrl WORD...`` from the PATH, which prints one candidate per line and
  then cobra's directive line (``:4``, no file completion; ``:0``, the shell's default).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

BASH = """# rtrl completion for bash: source <(rtrl completion bash)
_rtrl_complete() {
    local IFS=$'\\n'
    COMPREPLY=($(rtrl __complete "${COMP_WORDS[@]:1:COMP_CWORD}" 2>/dev/null))
}
complete -o default -F _rtrl_complete rtrl
"""
ZSH = "autoload -U +X bashcompinit && bashcompinit\n" + BASH.replace("bash", "zsh", 1)
SCRIPTS = {"bash": BASH, "zsh": ZSH}
# cobra's ShellCompDirective, as kubectl reads it from a plugin's completion command
NO_FILES, DEFAULT = 4, 0


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _option(parser: argparse.ArgumentParser, word: str) -> argparse.Action | None:
    flag = word.split("=", 1)[0]
    return next((a for a in parser._actions if flag in a.option_strings), None)


def candidates(parser: argparse.ArgumentParser, words: Sequence[str]) -> tuple[list[str], bool]:
    """What may follow ``words`` (the last one being the word typed so far, perhaps empty),
    and whether the shell should offer file names instead when there is none."""
    *done, current = list(words) or [""]
    node, value_of = parser, None
    for word in done:
        subcommands = _subcommands(node)
        if value_of is not None:  # this word was the previous flag's value
            value_of = None
        elif word in subcommands:
            node = subcommands[word]
        elif word.startswith("-") and "=" not in word:
            action = _option(node, word)
            takes_value = action is not None and action.nargs != 0
            value_of = action if takes_value else None
    if value_of is not None:  # a flag's value: its choices, or whatever the shell offers
        choices = [str(c) for c in value_of.choices or ()]
        return [c for c in choices if c.startswith(current)], not choices
    if current.startswith("-"):
        flags = {f for a in node._actions for f in a.option_strings if f.startswith(current)}
        return sorted(flags), False
    # a subcommand, or a positional argument's choices (`rtrl completion bash`)
    named = list(_subcommands(node)) or [
        str(c)
        for a in node._actions
        if not a.option_strings and not isinstance(a, argparse._SubParsersAction)
        for c in a.choices or ()
    ]
    return [n for n in named if n.startswith(current)], not named


def print_candidates(parser: argparse.ArgumentParser, words: Sequence[str]) -> int:
    """``rtrl __complete``: one candidate per line."""
    for word in candidates(parser, words)[0]:
        print(word)
    return 0


def print_for_kubectl(parser: argparse.ArgumentParser, words: Sequence[str]) -> int:
    """``kubectl_complete-rtrl``: the candidates, then cobra's directive line."""
    found, files = candidates(parser, words)
    for word in found:
        print(word)
    print(f":{DEFAULT if files else NO_FILES}")
    return 0
