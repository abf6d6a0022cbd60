"""What a benchmark result needs to be reproducible: the machine and the code it ran."""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def machine_info() -> dict[str, Any]:
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "mem_gb": round(mem_gb, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
    }


def source_info(repo: Path) -> dict[str, Any]:
    """The commit of the code under test and whether transfer/ or agent/ differ from it."""

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, text=True, check=False
        )
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "HEAD")
    changed = git("status", "--porcelain", "--", "transfer", "agent")
    digest = hashlib.sha256()
    for path in sorted([*repo.glob("transfer/**/*.py"), *repo.glob("agent/**/*.py")]):
        digest.update(path.relative_to(repo).as_posix().encode() + b"\0")
        digest.update(path.read_bytes())
    return {
        "repo": str(repo),
        "commit": commit or "unknown",
        "library_modified": bool(changed),
        "modified_files": changed.splitlines(),
        # identifies the exact code run, committed or not
        "library_sha256": digest.hexdigest()[:16],
    }


def describe_source(before: dict[str, Any], after: dict[str, Any]) -> str:
    """One line for a results header; flags code that changed while the benchmark ran."""
    text = f"ferry at {before['commit'][:10]}"
    if before["library_modified"]:
        text += f" + uncommitted changes (library sha256 {before['library_sha256']})"
    if after["library_sha256"] != before["library_sha256"]:
        text += " -- WARNING: the library changed while this ran; results mix two versions"
    return text


def reproduce_command(argv: list[str]) -> str:
    """The shell command that reruns a benchmark, with the external S3 endpoint if one was
    used (the default is a server the benchmark starts itself)."""
    ext = os.environ.get("FERRY_TEST_S3_ENDPOINT")
    return (f"FERRY_TEST_S3_ENDPOINT={shlex.quote(ext)} " if ext else "") + shlex.join(argv)


def run_and_record(
    module: str,
    argv: list[str] | None,
    parse_args: Callable[[list[str] | None], argparse.Namespace],
    run: Callable[[argparse.Namespace], dict[str, Any]],
    report: Callable[[dict[str, Any]], str],
    stem: Callable[[argparse.Namespace], str],
) -> int:
    """A benchmark's ``main``: print the command that reproduces it, run it, print its
    report and write it (``write_results``) under ``args.out_dir`` as ``stem(args)``."""
    args = parse_args(argv)
    command = reproduce_command([sys.executable, "-m", module,
                                 *(sys.argv[1:] if argv is None else argv)])  # fmt: skip
    print(command, flush=True)
    doc = run(args)
    md = report(doc)
    print(md)
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    write_results(args.out_dir, stem(args), command, date, md, **doc)
    return 0


def write_results(
    out_dir: Path, stem: str, command: str, date_utc: str, md: str, **fields: Any
) -> None:
    """``<stem>.md`` (the table) and ``<stem>.json`` (the figures, with the command, the
    machine and the code that made them) under ``out_dir``."""
    import json

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.md").write_text(md)
    doc = {
        "command": command,
        "date_utc": date_utc,
        "machine": machine_info(),
        "source": source_info(Path(__file__).resolve().parent.parent),
        **fields,
    }
    (out_dir / f"{stem}.json").write_text(json.dumps(doc, indent=1) + "\n")


_COMPILED: set[Path] = set()


def ferry_command(repo: Path | None = None) -> list[str]:
    """The argv that runs ``ferry`` from ``repo`` (this checkout by default), its bytecode
    compiled first, as a wheel install compiles it: an editable checkout run under
    PYTHONDONTWRITEBYTECODE (set on these machines) compiles ~50 modules from source at
    every start, 0.07-0.09 s per command here (a 3 MB pull, cold cache: 0.43-0.46 s
    against 0.36-0.37 s with the bytecode; ``s5cmd cp`` 0.17-0.23 s) that an installed
    ferry never pays."""
    import compileall
    import sys

    root = (repo or Path(__file__).resolve().parent.parent).resolve()
    if root not in _COMPILED:
        for package in ("transfer", "agent"):
            compileall.compile_dir(str(root / package), quiet=1)
        _COMPILED.add(root)
    return [sys.executable, "-m", "agent"]
