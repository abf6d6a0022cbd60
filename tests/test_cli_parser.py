"""The CLI's parser: a command line naming a command builds that command's parser alone
(every command's flags cost ~10 ms of each start, which `ferry pull` through the agent exists
to spare); the parser it builds must be the one the full parser has for that command."""

from __future__ import annotations

import argparse

import pytest

from agent.cli.run import _GROUPS, build_parser
from agent.cli.run import main as ferry


def commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


@pytest.mark.parametrize("names", list(_GROUPS), ids="/".join)
def test_a_named_command_builds_its_own_parser_alone_and_the_same_one(
    names: tuple[str, ...],
) -> None:
    everything = commands(build_parser())
    for name in names:
        alone = commands(build_parser([name, "--json"]))
        assert set(alone) == set(names)  # (a group's key names exactly what it adds)
        assert alone[name].format_help() == everything[name].format_help()


def test_every_command_is_in_one_group_and_no_command_names_every_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    grouped = [name for names in _GROUPS for name in names]
    assert sorted(grouped) == sorted(commands(build_parser()))
    assert len(set(grouped)) == len(grouped)
    for line in ([], ["--version"], ["pul"]):  # nothing, no command, an unknown one
        assert set(commands(build_parser(line))) == set(grouped)
    with pytest.raises(SystemExit) as stopped:
        ferry(["pul", "s", "d"])  # a typo is told its choices
    assert stopped.value.code == 2
    assert "invalid choice: 'pul' (choose from" in capsys.readouterr().err
