"""The CLI's parser: a command line naming a command builds that command's parser alone
(every command's flags cost ~10 ms of each start, which `ferry pull` through the agent exists
to spare); the parser it builds must be the one the full parser has for that command."""

from __future__ import annotations

import argparse
from pathlib import Path

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


def test_a_command_run_builds_no_other_commands_parser(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from agent.cli import run

    def built(sub: object) -> None:
        raise AssertionError("another command's parser was built")

    for names in _GROUPS:
        if "ls" not in names:
            monkeypatch.setitem(run._GROUPS, names, built)
    assert ferry(["ls", str(tmp_path / "no-store")]) == 1  # (its own error: no store there)
    assert "does not exist" in capsys.readouterr().err


def test_the_top_levels_help_lists_every_command_even_before_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for line in (["-h", "pull"], ["--help", "ls"]):
        with pytest.raises(SystemExit):
            ferry(line)
        said = capsys.readouterr().out
        assert all(name in said for names in _GROUPS for name in names), said


@pytest.mark.parametrize(
    ("line", "hint"),
    [
        (["pul", "s", "d"], "did you mean 'pull'?"),
        (["verfy", "s"], "did you mean 'verify'?"),
        (["ls", "s", "--jsno"], "did you mean '--json'?"),
        (["pull", "s", "d", "--job", "j", "--bsae-dir=x"], "did you mean '--base-dir'?"),
        (["pull", "s", "d", "--job", "j", "--qqqqqq"], None),  # nothing close: no guess
        (["pull", "s", "d", "--jbo", "j"], "did you mean '--job'?"),  # a required one, typo'd
        (["pull", "s", "d"], None),  # a required one, not given at all
    ],
)
def test_a_typo_is_told_the_nearest_command_or_option(
    line: list[str], hint: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    """A newcomer's `ferry pul` got every command and no pointer into them."""
    with pytest.raises(SystemExit) as stopped:
        ferry(line)
    said = capsys.readouterr().err
    assert stopped.value.code == 2 and len(said.splitlines()) == 1, said
    assert said.endswith("--help)\n"), said
    assert (hint in said) if hint else "did you mean" not in said, said
