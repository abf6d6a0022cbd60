"""Bad input gets a clear error and loses nothing."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
from pathlib import Path

import pytest

from agent.cli.run import main as ferry
from agent.rpc.client import FerryClient
from tests.conftest import (
    make_checkpoint,
    open_test_store,
    put_object,
    random_bytes,
    store_objects,
    tree_bytes,
    write_file,
)
from tests.harness import TOKEN, agent, push_series
from transfer.engine.catalog import load_manifest
from transfer.format import layout
from transfer.format.layout import PACKS_PREFIX, manifest_key

SMALL = ["--chunk-size-mib", "1", "--part-size-mib", "5", "--pack-size-mib", "10"]


def ferry_misused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run ferry expecting a usage error (exit 2); return what it said on stderr."""
    with pytest.raises(SystemExit) as exc:
        ferry(list(argv))
    assert exc.value.code == 2
    return capsys.readouterr().err


def ferry_fails(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run ferry expecting exit 1; return the one-line reason from stderr."""
    code = ferry(list(argv))
    err = capsys.readouterr().err
    assert code == 1, err
    assert err.startswith("ferry ") and "error" in err
    return err


def pushed(store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    src = make_checkpoint(tmp_path / "step_000007", shard_bytes=3_000_000)
    assert ferry(["push", str(src), store_url, "--job", "j", "--node", "n", *SMALL]) == 0
    capsys.readouterr()
    return src


def test_pushing_a_file_instead_of_a_save_directory_says_so(
    local_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A regular file given as the save was taken for a partial copy whose marker could not
    be read ("a share (unreadable: Not a directory) of None step None")."""
    afile = tmp_path / "afile"
    afile.write_bytes(b"x" * 1000)
    err = ferry_fails(capsys, "push", str(afile), local_url, "--job", "j", "--step", "6")
    assert "is not a directory" in err and "None" not in err and "partial" not in err, err
    assert len(err.splitlines()) == 1


def test_a_checkpoint_path_that_does_not_exist_is_named_first(
    tmp_path: Path, local_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A typo'd path was told "cannot tell the step from 'exist': pass --step" (usage, exit
    2); with --step it then learnt the directory is none. Now the first answer says so."""
    missing = tmp_path / "does" / "not" / "exist"
    err = ferry_fails(capsys, "push", str(missing), local_url, "--job", "j", "--node", "n")
    assert err.strip() == (
        f"ferry push: error: checkpoint directory {missing} does not exist or is not a directory"
    ), err


@pytest.mark.parametrize("name", ["llama-7b", "run2024v3"])
def test_a_step_is_not_taken_from_digits_inside_a_name(
    tmp_path: Path, local_url: str, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    """A newcomer's trial: ``llama-7b`` was pushed as step 7 and ``run2024v3`` as step 3.
    A step is taken from digits that end the name (``checkpoint-500``, ``global_step42``)."""
    src = make_checkpoint(tmp_path / name)
    err = ferry_misused(capsys, "push", str(src), local_url, "--job", "j", "--node", "n")
    assert f"cannot tell the step from {name!r}" in err and "--step" in err, err
    assert not [k for k in store_objects(local_url) if k.startswith("manifests/")]
    for named, step in (("checkpoint-500", 500), ("global_step42", 42), ("iter_0000500", 500)):
        assert ferry(["push", str(make_checkpoint(tmp_path / named)), local_url,
                      "--job", "j", "--node", "n", *SMALL]) == 0  # fmt: skip
        assert f"pushed j step {step} node n" in capsys.readouterr().out


def test_a_small_step_says_its_rate_in_a_unit_that_shows_it(
    tmp_path: Path, local_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A newcomer's trial: a step of a few KB pushed and pulled "at 0 MB/s"."""
    src = tmp_path / "step_000001"
    write_file(src / "notes.txt", b"hello\n" * 500)
    assert ferry(["push", str(src), local_url, "--job", "j", "--node", "n"]) == 0
    assert ferry(["pull", local_url, str(tmp_path / "out"), "--job", "j", "--step", "1"]) == 0
    out = capsys.readouterr().out
    rates = re.findall(r"([\d,.]+) (B|KB|MB|GB)/s", out)
    assert len(rates) == 2 and all(float(n.replace(",", "")) > 0 for n, _ in rates), out


def test_a_store_given_as_the_checkpoint_is_refused(
    tmp_path: Path, local_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``ferry push STORE OTHER_STORE`` pushed the first store's files as "step 1"."""
    other = tmp_path / "other-1"
    assert ferry(["init", str(other)]) == 0
    capsys.readouterr()
    err = ferry_misused(capsys, "push", local_url, str(other), "--job", "j", "--step", "1")
    assert "is a ckpt-ferry store, not a checkpoint" in err, err


def test_a_jobs_directory_of_steps_is_refused_not_pushed_as_one_step(
    tmp_path: Path, local_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``ferry push ckpt/llama`` (the job's directory): told "pass --step", a newcomer did,
    and every step was pushed nested inside one step. It is refused, naming the steps."""
    job = tmp_path / "llama"
    for step in (10, 20):
        make_checkpoint(job / f"step_{step:06d}")
    err = ferry_misused(capsys, "push", str(job), local_url, "--job", "j", "--step", "5")
    assert f"{job} holds step directories (step_000010, step_000020): push one of them" in err
    assert not (Path(local_url) / "manifests" / "j").exists()  # nothing pushed


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        ferry(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("ferry 0.")


def test_store_path_that_does_not_exist(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = make_checkpoint(tmp_path / "step_000001")
    missing = tmp_path / "no" / "such" / "store"
    err = ferry_fails(capsys, "push", str(src), str(missing), "--job", "j", "--node", "n")
    assert "does not exist" in err
    assert not missing.exists(), "push must not create a store where a mount was expected"
    err = ferry_fails(capsys, "pull", str(missing), str(tmp_path / "d"), "--job", "j")
    assert "does not exist" in err
    assert not (tmp_path / "d").exists()


def test_missing_bucket(s3_env, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    src = make_checkpoint(tmp_path / "step_000001")
    err = ferry_fails(capsys, "push", str(src), "s3://no-such-bucket-ferry/x", "--job", "j")
    assert "does not exist" in err


def test_wrong_credentials(
    s3_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    src = pushed(s3_url, tmp_path, capsys)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "definitely-wrong")
    err = ferry_fails(capsys, "push", str(src), s3_url, "--job", "j", "--step", "8", "--node", "n")
    assert "access denied" in err and "credentials" in err
    err = ferry_fails(capsys, "pull", s3_url, str(tmp_path / "d"), "--job", "j")
    assert "access denied" in err
    assert not (tmp_path / "d").exists()


def test_no_credentials_at_all_is_said_so_not_blamed_on_a_key(
    s3_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A newcomer's trial: with no credentials anywhere, the error was the server's
    "InvalidAccessKeyId: The access key ID you provided does not exist" (none was given)."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    for argv in (["ls", s3_url], ["pull", s3_url, str(tmp_path / "d"), "--job", "j"]):
        err = ferry_fails(capsys, *argv)
        assert "no AWS credentials found" in err and "InvalidAccessKeyId" not in err, err
        assert len(err.splitlines()) == 1


def test_access_denied_is_one_readable_line_with_the_s3_code_and_message(
    s3_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 29 (a): access denied embedded the reply's raw XML, cut mid-word
    ("<Error><Code>SignatureDoesNotMatch</Code><Message>); check..."). Now: the bucket and
    key, "access denied", the S3 error's Code and Message, on every transport."""
    from transfer.errors import AccessDeniedError
    from transfer.store.retry import RetryPolicy
    from transfer.store.s3client import S3Client, S3Settings

    src = pushed(s3_url, tmp_path, capsys)
    bucket, prefix = s3_url.removeprefix("s3://").split("/", 1)
    said = "SignatureDoesNotMatch: The request signature we calculated does not match"

    def readable(line: str, key: str) -> None:
        assert "\n" not in line.strip() and "<" not in line and "xml" not in line, line
        assert f"access denied to s3://{bucket}/{prefix}/{key}" in line, line
        assert said in line and line.rstrip().endswith("check the AWS credentials"), line

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "definitely-wrong")
    for argv in (
        ["push", str(src), s3_url, "--job", "j", "--step", "8", "--node", "n"],
        ["pull", s3_url, str(tmp_path / "d"), "--job", "j"],
        ["ls", s3_url],
    ):
        readable(ferry_fails(capsys, *argv), "")
    # each transport: obstore (get, list), s3ranges (ranged reads), botocore (writes)
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    key_id = os.environ["AWS_ACCESS_KEY_ID"]
    client = S3Client(
        S3Settings(bucket, endpoint, key=key_id, secret="wrong"), RetryPolicy(attempts=1)
    )
    full = f"{prefix}/ferry-store.json"
    try:
        for attempt, key in (
            (lambda: client.get(full, "get ferry-store.json"), "ferry-store.json"),
            (lambda: client.list(f"{prefix}/ferry", "list 'ferry'"), "ferry"),
            (
                lambda: client.read_into(full, 0, memoryview(bytearray(8)), "get"),
                "ferry-store.json",
            ),
            (lambda: client.call("put_object", "put", Key=full, Body=b"x"), "ferry-store.json"),
        ):
            with pytest.raises(AccessDeniedError) as denied:
                attempt()
            readable(str(denied.value), key)
    finally:
        client.close()


def corrupt_first_pack(store_url: str) -> str:
    """Flip one byte in the middle of the first pack, through the store API."""

    async def go() -> str:
        store = open_test_store(store_url)
        try:
            key = next(o.key for o in await store.list(PACKS_PREFIX))
            data = bytearray(await store.get(key))
            data[len(data) // 2] ^= 0x40
            await store.put(key, bytes(data))
            return key
        finally:
            await store.close()

    return asyncio.run(go())


def test_corrupt_chunk_fails_pull_and_verify_naming_it(
    store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pushed(store_url, tmp_path, capsys)
    assert ferry(["verify", store_url]) == 0
    capsys.readouterr()
    corrupt_first_pack(store_url)

    dest = tmp_path / "restore"
    err = ferry_fails(capsys, "pull", store_url, str(dest), "--job", "j", *SMALL)
    assert "corrupt" in err and "chunk " in err
    assert not dest.exists(), "a failed pull leaves nothing behind"
    assert [p.name for p in tmp_path.iterdir() if "staging" in p.name] == []

    code = ferry(["verify", store_url, "--json", *SMALL])
    out, err = capsys.readouterr()
    assert code == 1
    doc = json.loads(out)
    assert doc["ok"] is False and len(doc["bad_chunks"]) == 1
    bad = doc["bad_chunks"][0]
    assert bad["chunk"] in err and "BAD chunk" in err
    # chunks land in packs in completion order, so either shard may own the flipped byte
    assert len(bad["used_by"]) == 1
    assert bad["used_by"][0] in ("j/7/n:__0_0.distcp", "j/7/n:__1_0.distcp")


def test_missing_pack_is_reported_not_treated_as_empty(
    store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pushed(store_url, tmp_path, capsys)

    async def drop() -> None:
        store = open_test_store(store_url)
        try:
            for o in await store.list(PACKS_PREFIX):
                await store.delete(o.key)
        finally:
            await store.close()

    asyncio.run(drop())
    err = ferry_fails(capsys, "pull", store_url, str(tmp_path / "d"), "--job", "j")
    assert "missing" in err
    assert ferry(["verify", store_url]) == 1


def write_manifest(store_url: str, doc: dict) -> None:  # type: ignore[type-arg]
    async def go() -> None:
        store = open_test_store(store_url)
        try:
            key = manifest_key(doc["job"], doc["step"], doc["node"])
            await store.put(key, json.dumps(doc).encode())
        finally:
            await store.close()

    asyncio.run(go())


def load_manifest_doc(store_url: str) -> dict:  # type: ignore[type-arg]
    async def go() -> bytes:
        store = open_test_store(store_url)
        try:
            return await store.get(manifest_key("j", 7, "n"))
        finally:
            await store.close()

    return json.loads(asyncio.run(go()))  # type: ignore[no-any-return]


@pytest.mark.parametrize("evil", ["../escaped.bin", "/tmp/abs-escape.bin", "a/../../x", "./x", ""])
def test_manifest_paths_escaping_the_destination_are_refused(
    store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], evil: str
) -> None:
    pushed(store_url, tmp_path, capsys)
    doc = load_manifest_doc(store_url)
    doc["files"][0]["path"] = evil
    write_manifest(store_url, doc)
    box = tmp_path / "box"
    box.mkdir()
    before = sorted(p.name for p in tmp_path.iterdir())
    err = ferry_fails(capsys, "pull", store_url, str(box / "dest"), "--job", "j")
    assert "unsafe file path" in err
    assert list(box.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert not Path("/tmp/abs-escape.bin").exists()


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(version=99), "version 99 is not supported"),
        (lambda d: d["files"][0]["chunks"][0].update(enc="zstd+future"), "unknown"),
        (lambda d: d["files"][0].update(size=d["files"][0]["size"] + 1), "do not add up"),
        (lambda d: d["files"][0]["chunks"][0].update(size=1 << 40), "size"),
        (lambda d: d["files"][0]["chunks"][0].update(pack=99), "pack"),
        (lambda d: d.update(job="other"), "describes"),
        (lambda d: d.update(version="2"), "version '2' is not supported"),
        (lambda d: d.update(format="something-else"), "not a ckpt-ferry manifest"),
        (lambda d: d.update(hash="sha256"), "hash 'sha256' is not supported"),
        (lambda d: d["files"].append(dict(d["files"][0])), "twice"),
        (lambda d: d["files"][0].update(size=1 << 60), "size"),
        (lambda d: d["files"][0].update(mode="0644"), "mode"),
        (lambda d: d["files"][0].update(chunks={"0": 1}), "'chunks' must be a list"),
        (lambda d: d["files"][0]["chunks"][0].update(offset=-1), "offset"),
        (lambda d: d["files"][0]["chunks"][0].update(stored=1 << 40), "stored"),
        (lambda d: d["files"][0]["chunks"][0].update(id="../" + "0" * 61), "chunk id"),
        (lambda d: d["files"][0]["chunks"][0].update(enc="xor+zstd", base="e" * 64), "base"),
        (lambda d: d["files"][0]["chunks"][0].update(enc="zstd", base="e" * 64), "disagree"),
        (lambda d: d.update(packs=["../../etc/passwd"]), "pack"),
        (lambda d: d.update(chunk_size=1 << 40), "chunk_size"),
        (lambda d: d.update(files=[{}] * 3), "path"),
    ],
)
def test_malformed_manifests_are_refused_clearly(
    store_url: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    mutate,
    message,  # type: ignore[no-untyped-def]
) -> None:
    pushed(store_url, tmp_path, capsys)
    doc = load_manifest_doc(store_url)
    mutate(doc)

    async def put_raw() -> None:
        store = open_test_store(store_url)
        try:
            await store.put(manifest_key("j", 7, "n"), json.dumps(doc).encode())
        finally:
            await store.close()

    asyncio.run(put_raw())
    before = sorted(p.name for p in tmp_path.iterdir())
    err = ferry_fails(capsys, "pull", store_url, str(tmp_path / "d"), "--job", "j")
    assert message in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing, not even staging


def test_unknown_store_version_is_refused(
    store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = pushed(store_url, tmp_path, capsys)

    put_object(store_url, "ferry-store.json", b'{"format": "ckpt-ferry-store", "version": 2}')
    err = ferry_fails(capsys, "pull", store_url, str(tmp_path / "d"), "--job", "j")
    assert "version 2 is not supported" in err
    err = ferry_fails(capsys, "push", str(src), store_url, "--job", "j", "--step", "9")
    assert "version 2 is not supported" in err


def test_destination_must_be_new_or_empty(
    local_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pushed(local_url, tmp_path, capsys)
    dest = tmp_path / "busy"
    dest.mkdir()
    (dest / "keep.txt").write_text("precious")
    err = ferry_fails(capsys, "pull", local_url, str(dest), "--job", "j")
    assert "not empty" in err
    assert tree_bytes(dest) == {"keep.txt": b"precious"}
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere").mkdir()  # an empty directory, but behind a symlink
    err = ferry_fails(capsys, "pull", local_url, str(tmp_path / "link"), "--job", "j")
    assert "not a directory" in err and list((tmp_path / "elsewhere").iterdir()) == []
    empty = tmp_path / "empty"
    empty.mkdir()
    assert ferry(["pull", local_url, str(empty), "--job", "j"]) == 0


def test_a_pull_run_again_into_its_own_restore_finds_it_whole(
    local_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A pull killed once its restore was in place, then run again, said "not empty" (a
    newcomer's trial): the step already there, every chunk checked, is success with
    nothing fetched; a destination that differs in one byte is still refused, untouched."""
    src = pushed(local_url, tmp_path, capsys)
    dest = tmp_path / "restored"
    assert ferry(["pull", local_url, str(dest), "--job", "j"]) == 0
    capsys.readouterr()
    (dest / "notes.txt").write_text("the user's own")  # (a file beside the step's is fine)
    assert ferry(["pull", local_url, str(dest), "--job", "j", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["already_there"] is True and doc["bytes_transferred"] == 0
    assert doc["write_path"] == "none", doc  # (was "": a newcomer read it as a missing field)
    assert ferry(["pull", local_url, str(dest), "--job", "j"]) == 0
    assert "already holds j step 7" in capsys.readouterr().out
    (dest / "notes.txt").unlink()
    assert tree_bytes(dest) == tree_bytes(src)

    victim = next(p for p in sorted(dest.iterdir()) if p.stat().st_size > 0)
    changed = bytearray(victim.read_bytes())
    changed[-1] ^= 0xFF
    victim.write_bytes(changed)
    before = tree_bytes(dest)
    err = ferry_fails(capsys, "pull", local_url, str(dest), "--job", "j")
    assert "is not empty, and not j step 7" in err and f"{victim.name}: the chunk at offsets" in err
    assert tree_bytes(dest) == before


def test_repush_with_different_content_is_refused(
    local_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = pushed(local_url, tmp_path, capsys)
    packs = [k for k in store_objects(local_url) if k.startswith(PACKS_PREFIX)]
    (src / "__0_0.distcp").write_bytes(b"different")
    err = ferry_fails(capsys, "push", str(src), local_url, "--job", "j", "--node", "n", *SMALL)
    assert "already committed with different content" in err
    assert [k for k in store_objects(local_url) if k.startswith(PACKS_PREFIX)] == packs


def test_usage_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "no-number-here"
    d.mkdir()
    with pytest.raises(SystemExit) as exc:
        ferry(["push", str(d), str(tmp_path), "--job", "j"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        ferry(["pull", str(tmp_path), str(tmp_path / "x")])  # --job missing
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        ferry(["pull", str(tmp_path), str(tmp_path / "x"), "--job", "j", "--step", "soon"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:  # (exit 1 before, where "soon" was 2: a trial)
        ferry(["pull", str(tmp_path), str(tmp_path / "x"), "--job", "j", "--step", "-1"])
    assert exc.value.code == 2
    # each in one line, saying where the usage is (not a screenful of every option first)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 4 and all(line.endswith("--help)") for line in lines), lines
    assert "--step must be within 0.." in lines[3], lines
    assert lines[0].startswith("ferry push: error: cannot tell the step"), lines
    assert "required: --job" in lines[1], lines
    with pytest.raises(SystemExit) as exc:
        ferry(["push", str(d), str(tmp_path), "--job", "j", "--bogus"])
    assert exc.value.code == 2
    assert capsys.readouterr().err == (
        "ferry push: error: unrecognized arguments: --bogus (see ferry push --help)\n"
    )
    assert ferry(["push", str(d), str(tmp_path), "--job", "bad/name", "--step", "1"]) == 1
    assert "invalid job name" in capsys.readouterr().err
    # (a newcomer's trial: --node '' fell back to $FERRY_NODE or the host name unsaid)
    assert ferry(["push", str(d), str(tmp_path), "--job", "j", "--step", "1", "--node", ""]) == 1
    assert "invalid node name ''" in capsys.readouterr().err


def test_a_symlink_in_a_partly_held_step_dir_is_never_followed(
    local_url: str, tmp_path: Path
) -> None:
    """A node holding its own part gets the other parts moved in beside it; a symlinked
    directory in its step dir must not carry them out of the hot dir."""
    part_a, part_b = tmp_path / "a" / "step_000020", tmp_path / "b" / "step_000020"
    write_file(part_a / "sub" / "__0_0.distcp", b"a" * 5000)
    write_file(part_a / ".metadata", b"meta")
    write_file(part_b / "__1_0.distcp", b"b" * 5000)
    write_file(part_b / ".metadata", b"meta")
    outside = tmp_path / "outside"
    outside.mkdir()
    hot = tmp_path / "hot"

    async def go() -> dict:  # type: ignore[type-arg]
        await push_series(local_url, [part_a], node="a")
        await push_series(local_url, [part_b], node="b")
        here = hot / "llm" / "step_000020"
        shutil.copytree(part_b, here)
        (here / "sub").symlink_to(outside)  # planted, or left by a confused job
        async with agent(hot, [local_url], "b") as url, FerryClient(url, TOKEN) as client:
            return await client.wait_prefetch(await client.prefetch("llm", 20), within_s=60)

    done = asyncio.run(go())
    assert list(outside.iterdir()) == []
    assert done["state"] == "failed" and "symlink" in done["error"], done
    assert sorted(p.name for p in (hot / "llm").iterdir()) == ["step_000020"]  # no staging


def test_an_empty_store_url_never_makes_the_current_directory_a_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    src = make_checkpoint(tmp_path / "step_000001")
    monkeypatch.chdir(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    err = ferry_fails(capsys, "push", str(src), "", "--job", "x", "--node", "n")
    assert "store URL is empty" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("url", ["s3//bucket/x", "file//tmp/x", "memory//x"])
def test_a_url_whose_colon_was_lost_is_refused_not_made_a_local_store(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ferry init s3//bucket/x`` made ./s3/bucket/x a local store and exited 0; a local
    directory of that name is still reachable as ``./s3//bucket/x``."""
    monkeypatch.chdir(tmp_path)
    err = ferry_fails(capsys, "init", url)
    assert "mistyped" in err and f"./{url}" in err and len(err.splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []
    assert ferry(["init", f"./{url}"]) == 0
    assert (tmp_path / url.split("/")[0]).is_dir()


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("ftp://x/y", "cannot be opened from a URL alone"),  # (its filesystem wants a host)
        ("zip://x", "cannot be opened from a URL alone"),  # (and a file to open)
        ("file://../x", "file:///absolute/path, or the path alone (../x)"),
        ("file://", "names no path"),  # (it named the current directory)
        ("~nosuchuser-ferry/x", "no such user's home directory"),  # (a RuntimeError's traceback)
    ],
)
def test_a_url_no_store_can_be_made_of_fails_in_one_line(
    url: str, says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """A newcomer's trial: ``ferry ls ftp://x/y`` printed a traceback (fsspec's filesystem
    wanted a host) and another as the half-made filesystem was collected; ``zip://x`` said
    only "[Errno 21] Is a directory"; ``file://../x`` "names a remote host", no more."""
    monkeypatch.chdir(tmp_path)
    err = ferry_fails(capsys, "ls", url)
    assert says in err and len(err.splitlines()) == 1, err
    assert "Traceback" not in err and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--chunk-size-mib", "0"], "--chunk-size-mib must be within 1..64"),
        (["--window", "0"], "--window and --workers must be positive"),
        (["--zstd-level", "99"], "--zstd-level must be at most 22"),
        (["--part-size-mib", "1", "--chunk-size-mib", "4"], "--part-size-mib must be at least"),
        (["--dedupe-steps", "-1"], "--dedupe-steps must be 0 or more"),  # (was accepted)
        (["--attempts", "0"], "--attempts must be at least 1"),  # (exited 1, no flag named)
        (["--read-timeout-seconds", "0"], "--connect/read-timeout-seconds must be positive"),
    ],
)
def test_transfer_flags_that_cannot_work_are_usage_errors_naming_them(
    flags: list[str], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A newcomer's trial: ``--chunk-size-mib 0`` said "chunk_size must be within ..." and
    exited 1, ``--zstd-level 99`` failed only at the first chunk, mid-push, as "level must
    be less than 23". A usage error (exit 2) naming the flag, before anything is made."""
    src = make_checkpoint(tmp_path / "step_000001")
    store = tmp_path / "store"
    err = ferry_misused(capsys, "push", str(src), str(store), "--init", "--job", "j", *flags)
    assert says in err and len(err.splitlines()) == 1, err
    assert not store.exists()


def test_an_empty_save_directory_is_not_committed(
    local_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An empty directory was committed as a 0-file step, and the real save of that step,
    pushed next, was refused as "already committed with different content"."""
    empty = tmp_path / "step_000007"
    empty.mkdir()
    err = ferry_fails(capsys, "push", str(empty), local_url, "--job", "j", "--node", "n")
    assert "holds no files" in err and len(err.splitlines()) == 1, err
    pushed(local_url, tmp_path, capsys)  # the save itself, same step: commits (exit 0)


def test_ls_of_a_directory_that_is_no_store_or_of_an_unknown_job_is_an_error(
    local_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plain = tmp_path / "just-a-dir"
    plain.mkdir()
    assert "is not a ckpt-ferry store" in ferry_fails(capsys, "ls", str(plain))
    pushed(local_url, tmp_path, capsys)
    err = ferry_fails(capsys, "ls", local_url, "--job", "typo")
    assert "no checkpoint of job 'typo'" in err and "jobs there: j" in err
    assert ferry(["ls", local_url, "--job", "j"]) == 0


def test_cli_errors_about_the_agent_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    token = tmp_path / "token"
    token.write_text("t0ken")
    token.chmod(0o600)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        hot = tmp_path / "hot"
        hot.mkdir()
        for key, value in {
            "FERRY_NODE": "a",
            "FERRY_HOT_DIR": str(hot),
            "FERRY_TOKEN_FILE": str(token),
            "FERRY_LISTEN": f"127.0.0.1:{port}",
        }.items():
            monkeypatch.setenv(key, value)
        err = ferry_fails(capsys, "agent")
        assert f"cannot listen on 127.0.0.1:{port}" in err and "Traceback" not in err
        assert list(hot.iterdir()) == []  # nothing started, not even its state dir
    # the port is free again, so connecting is refused: an agent URL without http:// is
    # taken as http://, and the refusal is one line
    err = ferry_fails(capsys, "estimate", f"127.0.0.1:{port}", "--job", "x",
                      "--token-file", str(token))  # fmt: skip
    assert f"http://127.0.0.1:{port}" in err and "Traceback" not in err
    # a path where the agent's address goes was asked of a host named after its first part
    err = ferry_fails(capsys, "estimate", "ckpt/store", "--job", "x", "--token-file", str(token))
    assert "agent URL 'ckpt/store' is not an agent's address" in err and "ckpt:80" not in err


def test_other_content_for_a_step_under_another_node_is_refused(
    local_url: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two parts of one step must merge: other bytes for the same file under a second node
    name would commit a step no pull can restore. Same bytes (a replicated .metadata, or
    the same save again under another name) still merge and pull."""
    monkeypatch.delenv("FERRY_NODE", raising=False)
    src = pushed(local_url, tmp_path, capsys)  # job j, node n
    before = store_objects(local_url)
    other = tmp_path / "other" / "step_000007"
    shutil.copytree(src, other)
    shard = other / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[::-1])  # same size, other bytes
    err = ferry_fails(capsys, "push", str(other), local_url, "--job", "j", "--node", "m", *SMALL)
    assert "would make it unrestorable: __0_0.distcp differs from node n's" in err
    assert [c.node for c in asyncio.run(_checkpoints(local_url))] == ["n"]
    assert store_objects(local_url) == before  # its packs were deleted, nothing committed
    # the same bytes under a second name: allowed, said out loud when the name defaulted
    assert ferry(["push", str(src), local_url, "--job", "j", *SMALL]) == 0
    assert "already has parts from node(s) n" in capsys.readouterr().err
    dest = tmp_path / "restored"
    assert ferry(["pull", local_url, str(dest), "--job", "j", "--step", "7"]) == 0
    assert tree_bytes(dest) == tree_bytes(src)


async def _checkpoints(url: str) -> list:  # type: ignore[type-arg]
    from transfer.engine.catalog import list_checkpoints

    store = open_test_store(url)
    try:
        return await list_checkpoints(store, "j")
    finally:
        await store.close()


def test_an_agent_that_cannot_start_says_why_and_leaves_nothing_running(
    s3_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its state dir is a regular file, so the push journal cannot open, after the start-up
    sweep has already used the S3 tier: `ferry agent` fails in one line, and what had
    started is released (agent/rpc/app.py: each resource its own cleanup), so none of the
    store's threads outlives the attempt."""
    import threading
    import time

    token = tmp_path / "token"
    token.write_text("t0ken")
    token.chmod(0o600)
    hot = tmp_path / "hot"
    hot.mkdir()
    (hot / "state").write_text("not a directory")
    for key, value in {
        "FERRY_NODE": "a",
        "FERRY_HOT_DIR": str(hot),
        "FERRY_STATE_DIR": str(hot / "state"),
        "FERRY_TIERS": s3_url,
        "FERRY_TOKEN_FILE": str(token),
        "FERRY_LISTEN": "127.0.0.1:0",
    }.items():
        monkeypatch.setenv(key, value)
    before = {t.ident for t in threading.enumerate()}
    err = ferry_fails(capsys, "agent")
    assert "state" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err

    def store_threads() -> list[str]:
        return [t.name for t in threading.enumerate()
                if t.ident not in before and t.is_alive() and t.name.startswith("s3")]  # fmt: skip

    deadline = time.monotonic() + 5  # released without waiting: they exit on their own
    while store_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not store_threads()


@pytest.mark.parametrize("command", ["ls", "push", "pull"])
@pytest.mark.parametrize("where", ["flag", "env"])
def test_an_endpoint_without_a_scheme_is_one_line_not_a_panic(
    command: str,
    where: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--endpoint-url 127.0.0.1:41007`` (or AWS_ENDPOINT_URL without http://) made the S3
    reader panic (a Rust backtrace, then ``PanicException: request valid``); it is refused
    in one line where every endpoint is resolved, naming what was meant."""
    ckpt = make_checkpoint(tmp_path / "step_000001", shard_bytes=10_000)
    args = {
        "ls": ["ls", "s3://bucket/p"],
        "push": ["push", str(ckpt), "s3://bucket/p", "--job", "j", "--node", "n"],
        "pull": ["pull", "s3://bucket/p", str(tmp_path / "out"), "--job", "j"],
    }[command]
    if where == "flag":
        args += ["--endpoint-url", "127.0.0.1:41007"]
    else:
        monkeypatch.setenv("AWS_ENDPOINT_URL", "127.0.0.1:41007")
    err = ferry_fails(capsys, *args)
    assert "S3 endpoint '127.0.0.1:41007' is not an http(s) URL" in err
    assert "did you mean http://127.0.0.1:41007?" in err
    assert "Traceback" not in err and "panic" not in err.lower() and len(err.splitlines()) == 1


def test_the_command_as_run_flushes_its_output_and_keeps_its_exit_codes(
    local_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m agent`` as a user's shell runs it, its output a buffered pipe: what it
    printed arrives whole, and each outcome has its exit code and its one-line reason."""
    import subprocess
    import sys

    pushed(local_url, tmp_path, capsys)

    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # a pipe buffers

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "agent", *args]
        return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)

    listed = run("ls", local_url, "--json")
    assert listed.returncode == 0, listed.stderr
    assert [c["job"] for c in json.loads(listed.stdout)["checkpoints"]] == ["j"]
    helped = run("--help")
    assert helped.returncode == 0 and helped.stdout.startswith("usage: ferry")
    misused = run("pull")
    assert misused.returncode == 2 and "the following arguments are required" in misused.stderr
    failed = run("pull", local_url, str(tmp_path / "dest"), "--job", "nope", "--json")
    assert failed.returncode == 1 and json.loads(failed.stdout)["ok"] is False
    assert len(failed.stderr.splitlines()) == 1 and "nope" in failed.stderr, failed.stderr


def test_ferry_estimate_says_what_it_could_not_reach_in_words(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A token file that is not there and an agent that is not up: one line each, in words
    (they were "[Errno 2] No such file or directory: 'nope.token'" and aiohttp's "Cannot
    connect to host 127.0.0.1:7199 ssl:default [Connect call failed ...]")."""
    from tests.harness import reserve_port

    url = f"http://127.0.0.1:{reserve_port()}"  # (held, never listening: refused)
    missing = tmp_path / "nope.token"
    err = ferry_fails(capsys, "estimate", url, "--token-file", str(missing), "--job", "j")
    assert err == f"ferry estimate: error: --token-file {missing}: No such file or directory\n"
    (tmp_path / "token").write_text("t\n")
    err = ferry_fails(
        capsys, "estimate", url, "--token-file", str(tmp_path / "token"), "--job", "j"
    )
    assert err == f"ferry estimate: error: {url}: cannot reach the agent (Connection refused)\n"


@pytest.mark.parametrize(
    ("share", "said"),
    [
        (["--world-size", "0", "--ranks", "0"], "world size: expected an integer in 1.."),
        (["--world-size", "2", "--ranks", "5"], "ranks: 5 is not a rank of a world of 2"),
    ],
)
def test_a_share_that_cannot_exist_is_a_usage_error(
    share: list[str], said: str, local_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--world-size 0`` or a rank outside the world: exit 2 and "see --help", as the other
    flags' mistakes are (it was exit 1), and nothing written."""
    pushed(local_url, tmp_path, capsys)
    out = tmp_path / "out"
    err = ferry_misused(capsys, "pull", local_url, str(out), "--job", "j", *share)
    assert said in err and "(see ferry pull --help)" in err and not out.exists(), err


@pytest.mark.parametrize("command", [["demo"], ["agent"], ["pull", "x", "y", "--job", "j"]])
def test_a_clone_whose_c_extension_was_never_built_says_so_in_one_line(
    command: list[str], tmp_path: Path
) -> None:
    """``python -m agent`` in a clone run before its install (a newcomer's first command):
    the C extension is missing. Each command said it with a traceback; now one line naming
    the install, exit 1. (The extension hidden in the child, as a missing file would be.)"""
    import subprocess
    import sys

    hide = "import sys; sys.modules['transfer.codec._planes'] = None; "
    run = "from agent.cli import main; raise SystemExit(main(sys.argv[1:]))"
    env = {**os.environ, "FERRY_HOT_DIR": str(tmp_path / "hot"), "FERRY_NODE": "a",
           "FERRY_TIERS": str(tmp_path / "store"), "FERRY_LISTEN": "127.0.0.1:0",
           "FERRY_STATE_DIR": str(tmp_path / "state")}  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", hide + run, *command],
        capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.endswith(
        "C extension (transfer/codec/_planes.c) is not built: install it first "
        "(`source scripts/env.sh`, or `pip install -e .`)\n"
    ), proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr


@pytest.mark.parametrize("command", [["ls"], ["du"], ["du", "--json"]])
def test_output_cut_short_by_its_reader_ends_quietly(
    command: list[str], local_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``ferry ls | head -1``: the reader goes away before ferry writes; ferry ends as a
    tool killed by SIGPIPE does (141, nothing on stderr), not with a BrokenPipeError
    traceback."""
    import subprocess
    import sys

    pushed(local_url, tmp_path, capsys)
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent", *command, local_url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the first line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


@pytest.mark.parametrize("command", ["push", "pull"])
def test_a_base_dir_that_is_not_there_is_refused(
    command: str, local_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--base-dir /nonexistent`` was taken as "nothing to reuse" (exit 0, "0 chunks
    reused"): a typo must say so, and leave the store and the destination untouched."""
    src = pushed(local_url, tmp_path, capsys)
    before = store_objects(local_url)
    missing = tmp_path / "no-such-dir"
    if command == "push":
        args = ["push", str(src), local_url, "--job", "j", "--node", "n2", *SMALL]
    else:
        args = ["pull", local_url, str(tmp_path / "out"), "--job", "j"]
    err = ferry_fails(capsys, *args, "--base-dir", str(missing))
    assert f"base directory {missing} does not exist or is not a directory" in err
    assert store_objects(local_url) == before and not (tmp_path / "out").exists()


def test_one_truncated_manifest_is_named_and_hides_nothing_else(
    local_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One cut manifest broke ``ls`` and ``verify`` of the whole store with "manifest is not
    valid JSON", naming no file: now ``ls`` lists it as unreadable, naming its key, beside
    the others, and ``verify`` checks the others and fails naming it."""
    src = pushed(local_url, tmp_path, capsys)  # job j, step 7, node n
    assert ferry(["push", str(src), local_url, "--job", "j", "--node", "m", *SMALL]) == 0
    key = manifest_key("j", 7, "m")
    path = Path(local_url) / key
    path.write_bytes(path.read_bytes()[:40])
    capsys.readouterr()
    assert ferry(["ls", local_url]) == 0
    out = capsys.readouterr().out
    assert f"UNREADABLE: {key}: manifest is not valid JSON" in out and " n " in out, out
    assert ferry(["verify", local_url]) == 1
    err = capsys.readouterr().err
    assert f"BAD manifest {key}: manifest is not valid JSON" in err
    assert "1 unreadable manifest(s), 0 BAD chunk(s)" in err


def test_an_in_process_store_is_refused_by_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``ferry push CKPT memory://x`` reported success, then the data was gone with the
    process: the one-shot CLI refuses memory:// (it stays for code and tests)."""
    ckpt = make_checkpoint(tmp_path / "step_000001", shard_bytes=10_000)
    with pytest.raises(SystemExit) as exited:
        ferry(["push", str(ckpt), "memory://scratch", "--job", "j", "--node", "n"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "an in-process (memory://) store lives only as long as one command" in err


def test_a_store_path_that_is_a_file_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file where the store directory should be was told "does not exist" (ls, push)
    or "File exists" (init)."""
    ckpt = make_checkpoint(tmp_path / "step_000001", shard_bytes=1000)
    afile = tmp_path / "afile"
    afile.write_bytes(b"not a store")
    for args in (["ls", str(afile)], ["init", str(afile)],
                 ["push", str(ckpt), str(afile), "--job", "j"]):  # fmt: skip
        capsys.readouterr()
        assert ferry(args) == 1, args
        assert f"store path {afile} is a file, not a directory" in capsys.readouterr().err
    assert afile.read_bytes() == b"not a store"


def test_a_mistyped_job_or_step_names_what_the_store_holds(
    local_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """verify said "nothing matches" where ls named the jobs there: every listing command
    now names them (and verify, the steps of the job)."""
    ckpt = make_checkpoint(tmp_path / "step_000010", shard_bytes=1000)
    assert ferry(["push", str(ckpt), local_url, "--job", "llama"]) == 0
    for command in ("ls", "du", "verify"):
        capsys.readouterr()
        assert ferry([command, local_url, "--job", "lama"]) == 1
        err = capsys.readouterr().err
        assert f"no checkpoint of job 'lama' in {local_url} (jobs there: llama)" in err, err
    assert ferry(["verify", local_url, "--job", "llama", "--step", "11"]) == 1
    assert "no step 11 of job 'llama'" in capsys.readouterr().err
    empty = tmp_path / "empty-store"
    assert ferry(["init", str(empty)]) == 0
    capsys.readouterr()
    assert ferry(["verify", str(empty)]) == 1
    assert f"{empty} holds no checkpoints" in capsys.readouterr().err


def test_a_save_with_an_unreadable_metadata_is_pushed_with_a_note(
    local_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A torn, empty or foreign .metadata beside DCP shards: pushed as it is (a lossless
    copy), but said at once, not first at a share pull of it days later."""
    for name, metadata in (("torn", b"\x80\x04\x95"), ("empty", b""), ("text", b"{}")):
        ckpt = tmp_path / name / "step_000300"
        ckpt.mkdir(parents=True)
        (ckpt / "__0_0.distcp").write_bytes(b"abc")
        (ckpt / ".metadata").write_bytes(metadata)
        assert ferry(["push", str(ckpt), local_url, "--job", name]) == 0
        err = capsys.readouterr().err
        assert f"{ckpt}/.metadata is not DCP metadata ferry can read" in err, (name, err)
    plain = tmp_path / "plain" / "step_000300"
    plain.mkdir(parents=True)
    (plain / ".metadata").write_bytes(b"not ours to judge")  # no DCP shards beside it
    assert ferry(["push", str(plain), local_url, "--job", "plain"]) == 0
    assert "not DCP metadata" not in capsys.readouterr().err


def test_a_save_without_metadata_is_refused_unless_it_is_a_part(
    local_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """DCP writes .metadata last: shards without it are an unfinished save, or one node's
    part (--part). A newcomer's trial: pushed with a note, the unfinished save became the
    job's newest step, and ``ferry retention --keep-last 1`` expired the step before it,
    the last one a DCP load could read. Refused now, with nothing written; --part pushes."""
    good = tmp_path / "good" / "step_000100"
    good.mkdir(parents=True)
    (good / "__0_0.distcp").write_bytes(b"abc")
    (good / ".metadata").write_bytes(b"not ours to judge")
    assert ferry(["push", str(good), local_url, "--job", "k"]) == 0
    ckpt = tmp_path / "step_000200"
    ckpt.mkdir()
    (ckpt / "__0_0.distcp").write_bytes(b"abc")
    err = ferry_misused(capsys, "push", str(ckpt), local_url, "--job", "k")
    assert "holds DCP shards but no .metadata" in err and "--part" in err, err
    assert ferry(["retention", local_url, "--keep-last", "1", "--grace", "0"]) == 0
    capsys.readouterr()
    assert ferry(["ls", local_url, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["checkpoints"]
    assert [(c["job"], c["step"]) for c in listed] == [("k", 100)], listed
    assert ferry(["push", str(ckpt), local_url, "--job", "j", "--node", "a", "--part"]) == 0
    assert "no .metadata" not in capsys.readouterr().err


def test_an_interrupted_push_says_how_to_tell_whether_it_committed(
    local_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """A newcomer's trial: Ctrl-C as a push committed printed "ferry push: interrupted",
    and ``ferry ls`` then listed the step. The message says how to tell, and what to run."""
    import transfer.engine

    async def stopped(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(transfer.engine, "push", stopped)
    src = make_checkpoint(tmp_path / "step_000001")
    assert ferry(["push", str(src), local_url, "--job", "j", "--node", "n"]) == 130
    err = capsys.readouterr().err
    assert "ferry push: interrupted: the step is committed only if `ferry ls` lists it" in err


@pytest.mark.parametrize("holds", ["shards only", "metadata and one shard"])
def test_retention_never_takes_a_pushed_part_for_the_newest_whole_step(
    holds: str, local_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A newcomer's trial: a whole save as step 50, then one node's part of step 60 pushed
    with --part (its shards without .metadata, or .metadata and a shard while .metadata
    names another). Retention --keep-last 1 kept step 60 as "newest complete" and expired
    step 50, the only step a pull could load. A part alone is never the step."""
    whole = tmp_path / "whole" / "step_000050"
    write_file(whole / "__0_0.distcp", b"a" * 5000)
    write_file(whole / "__1_0.distcp", b"b" * 5000)
    write_file(whole / ".metadata", b"metadata")
    part = tmp_path / "part" / "step_000060"
    write_file(part / "__1_0.distcp", b"c" * 5000)
    if holds == "metadata and one shard":
        write_file(part / ".metadata", b"metadata")
    assert ferry(["push", str(whole), local_url, "--job", "g", "--node", "n0"]) == 0
    assert ferry(["push", str(part), local_url, "--job", "g", "--node", "n1", "--part"]) == 0
    assert ferry(["retention", local_url, "--keep-last", "1", "--grace", "0"]) == 0
    capsys.readouterr()
    dest = tmp_path / "pulled"
    assert ferry(["pull", local_url, str(dest), "--job", "g", "--step", "50"]) == 0
    assert tree_bytes(dest) == tree_bytes(whole)


def test_retention_keeps_the_step_before_a_newest_step_that_lost_a_pack(
    local_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An operator's trial: a pack of the newest step lost (deleted by hand, a bucket
    policy, a failed disk), then retention --keep-last 1 expired the step before it, the
    last one that restored. A step whose parts need a pack the store does not hold is not
    a whole step: the run keeps the steps before it and names the step and the pack."""
    first, second = tmp_path / "step_000010", tmp_path / "step_000020"
    write_file(first / "weights.bin", random_bytes(300_000, 1))
    write_file(second / "weights.bin", random_bytes(300_000, 2))
    for d in (first, second):
        assert ferry(["push", str(d), local_url, "--job", "g", "--node", "n0"]) == 0
    store = Path(local_url)
    newer = asyncio.run(load_manifest(open_test_store(local_url), "g", 20, "n0")).packs
    for pack in newer:
        (store / layout.pack_key(pack)).unlink()
    with caplog.at_level(logging.WARNING, logger="transfer.retention.inventory"):
        assert ferry(["retention", local_url, "--keep-last", "1", "--grace", "0"]) == 0
    assert "g step 20 needs 1 pack(s) the store does not hold" in caplog.text
    dest = tmp_path / "pulled"
    assert ferry(["pull", local_url, str(dest), "--job", "g", "--step", "10"]) == 0
    assert tree_bytes(dest) == tree_bytes(first)


def test_repush_cut_in_other_chunks_says_it_cannot_compare(
    local_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A newcomer's trial: the same bytes pushed again with another chunk size were called
    "different content" (chunk ids of two cuts never match): now it says what differs."""
    src = pushed(local_url, tmp_path, capsys)
    err = ferry_fails(capsys, "push", str(src), local_url, "--job", "j", "--node", "n",
                      "--chunk-size-mib", "2")  # fmt: skip
    assert "cut in chunks of 1,048,576 bytes, and this push cut 2,097,152" in err, err
    assert "different content" not in err


def test_estimate_with_a_file_that_holds_no_token_names_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A newcomer's trial: the agent's config given as --token-file failed with aiohttp's
    "Forbidden control character detected in headers. Potential header injection attack."
    (the file's lines went into the Authorization header), naming neither."""
    config = tmp_path / "ferry.toml"
    config.write_text('hot_dir = "ckpt/hot"\nnode = "a"\n')
    err = ferry_fails(capsys, "estimate", "http://127.0.0.1:1", "--token-file", str(config),
                      "--job", "j", "--gpus", "1", "--gpu-hour-price", "1")  # fmt: skip
    assert f"--token-file {config}: not a bearer token" in err, err
    assert "header" not in err


def test_a_pull_of_a_step_or_job_not_there_names_what_is(
    local_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A newcomer's trial: `ferry verify --step 999` said which steps are there, `ferry pull`
    only that there was none."""
    pushed(local_url, tmp_path, capsys)
    err = ferry_fails(capsys, "pull", local_url, str(tmp_path / "o"), "--job", "j", "--step", "9")
    assert f"no step 9 of job 'j' in {local_url} (steps there: 7)" in err, err
    err = ferry_fails(capsys, "pull", local_url, str(tmp_path / "o"), "--job", "k")
    assert f"no checkpoint of job 'k' in {local_url} (jobs there: j)" in err, err
    assert not (tmp_path / "o").exists()


def test_a_failure_with_json_prints_one_object_naming_it_and_a_usage_error_none(
    local_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """README's shape: a script reading stdout gets ``ok: false``, the stderr line's reason
    and the error's class; a usage error prints nothing on stdout."""
    pushed(local_url, tmp_path, capsys)
    assert ferry(["pull", local_url, str(tmp_path / "out"), "--job", "typo", "--json"]) == 1
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc == {"ok": False, "error": doc["error"], "error_type": "CheckpointNotFoundError"}
    assert err.strip() == f"ferry pull: error: {doc['error']}"
    assert "no checkpoint of job 'typo'" in doc["error"]
    with pytest.raises(SystemExit) as exc:
        ferry(["pull", local_url, "--json"])
    assert exc.value.code == 2 and capsys.readouterr().out == ""
