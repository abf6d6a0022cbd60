"""The benchmark corpus: real training checkpoints at scale, in an 8-rank DCP layout.

What: three series of successive checkpoints of a real byte-level transformer trained with
AdamW on the CPython standard library (``bench.gen_checkpoints --mode torch``), every save
written by 8 torch.distributed ranks (gloo on loopback, DTensor ``Shard(0)``) as
``.metadata`` + ``__0_0.distcp`` .. ``__7_0.distcp``:

- ``full``: full fine-tuning, float32, ~1.6 GiB per save (weights + AdamW exp_avg and
  exp_avg_sq), saves at fine-tuning steps 20, 40, 60;
- ``frozen``: the same model with the embeddings and the first 6 of 8 blocks frozen while
  fine-tuning (their weights and AdamW state stay bit-identical), steps 20, 40, 60;
- ``bf16``: weights and AdamW state in bfloat16, ~1.6 GiB per save (twice the parameters),
  steps 20, 40; forward/backward in float32 (``--fp32-compute``: bf16 matmuls are 5-10x
  slower on this AVX2 CPU).

Why: random bytes, or small single-file series, are the wrong data for a tool that moves
multi-rank checkpoints between storage tiers and delta-codes successive saves.

How::

    nice -n 15 python -m bench.corpus /work/corpus     # ~23 min on 2 shared cores, 13.5 GB
    python -m bench.corpus /tmp/c --quick              # tiny, 2 ranks, 1-2 min (tests)

writes ``OUT_DIR/<variant>/step_XXXXXX/`` and ``OUT_DIR/corpus.json`` (per variant: model
shape, parameters, bytes per save, ranks, steps, the exact generating command, torch
version, generation seconds). Fixed parameters and seeds: rerunning regenerates the same
``*.distcp`` bytes (same thread count). A variant whose saves already exist complete, made
by the same command, is skipped, so a rerun is cheap. Pretraining is only 20 steps at batch
2 x 64 tokens: the point is real AdamW updates on a real model, not convergence.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import shlex
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench._env import machine_info
from bench.gen_checkpoints import plan_model

REPO = Path(__file__).resolve().parent.parent
COMMON = ["--mode", "torch", "--fused", "--seed", "0", "--warmup-steps", "20"]
COMMON += ["--save-every", "20", "--batch-size", "2", "--seq-len", "64"]
FULL = {  # variant -> (size MiB, saves, extra flags)
    "full": (1600.0, 3, []),
    "frozen": (1600.0, 3, []),
    "bf16": (1600.0, 2, ["--fp32-compute"]),
}
RANKS = 8
QUICK_COMMON = ["--mode", "torch", "--fused", "--seed", "0", "--warmup-steps", "2"]
QUICK_COMMON += ["--save-every", "2", "--batch-size", "2", "--seq-len", "32"]
QUICK = {v: (4.0, 2, extra) for v, (_, _, extra) in FULL.items()}
QUICK_RANKS = 2


def variant_argv(
    out: Path,
    variant: str,
    size_mb: float,
    saves: int,
    ranks: int,
    common: list[str],
    extra: list[str],
) -> list[str]:
    argv = ["python", "-m", "bench.gen_checkpoints", str(out / variant), *common]
    argv += ["--variant", variant, "--size-mb", f"{size_mb:g}", "--saves", str(saves)]
    return [*argv, "--ranks", str(ranks), *extra]


def is_complete(out: Path, entry: dict[str, Any] | None, command: str) -> bool:
    """Made by this command, and every step dir holds .metadata + one file per rank."""
    if not entry or entry.get("command") != command:
        return False
    want = {".metadata", *(f"__{r}_0.distcp" for r in range(entry["ranks"]))}
    for step in entry["steps"]:
        d = out / entry["variant"] / f"step_{step:06d}"
        if not d.is_dir() or {f.name for f in d.iterdir()} != want:
            return False
    return True


def describe(variant: str, size_mb: float, seq_len: int) -> dict[str, Any]:
    bf16 = variant == "bf16"
    plan = plan_model(size_mb, 6 if bf16 else 12, seq_len)
    shapes = plan.param_shapes()
    trainable = sum(math.prod(s) for n, s in shapes if variant != "frozen" or not plan.is_frozen(n))
    return {
        "dtype": "bfloat16" if bf16 else "float32",
        "model": {
            "d_model": plan.d_model,
            "d_ff": plan.d_ff,
            "n_layers": plan.n_layers,
            "n_heads": plan.n_heads,
            "seq_len": plan.seq_len,
            "vocab": plan.vocab,
        },
        "params": plan.n_params(),
        "trainable_params": trainable,
    }


def generate(out: Path, variant: str, argv: list[str]) -> tuple[list[dict[str, Any]], float]:
    """Run gen_checkpoints (progress on stderr); its ``key=value`` stdout lines, seconds."""
    shutil.rmtree(out / variant, ignore_errors=True)  # incomplete or made differently
    t = time.perf_counter()
    done = subprocess.run(
        [sys.executable, *argv[1:]], cwd=REPO, stdout=subprocess.PIPE, text=True, check=True
    )
    seconds = time.perf_counter() - t
    saves = []
    for line in done.stdout.splitlines():
        fields = dict(kv.split("=", 1) for kv in line.split())
        saves.append({k: v if k == "dir" else json.loads(v) for k, v in fields.items()})
    return saves, seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.corpus", description=__doc__)
    ap.add_argument("out_dir", type=Path, metavar="OUT_DIR")
    ap.add_argument("--quick", action="store_true", help="tiny models, 2 ranks (tests)")
    args = ap.parse_args(argv)
    out = args.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.quick:
        variants, common, ranks = QUICK, QUICK_COMMON, QUICK_RANKS
    else:
        variants, common, ranks = FULL, COMMON, RANKS
    shown = sys.argv[1:] if argv is None else argv
    index_path = out / "corpus.json"
    old = json.loads(index_path.read_text()) if index_path.exists() else {}
    index: dict[str, Any] = {
        "what": "bench.corpus: real AdamW training checkpoints, N-rank DCP layout",
        "command": shlex.join(["python", "-m", "bench.corpus", *shown]),
        "torch": importlib.metadata.version("torch"),
        "machine": machine_info(),
        "variants": {},
    }
    seq_len = int(common[common.index("--seq-len") + 1])
    for variant, (size_mb, saves, extra) in variants.items():
        cmd = variant_argv(out, variant, size_mb, saves, ranks, common, extra)
        command = shlex.join(cmd)
        entry = old.get("variants", {}).get(variant)
        if entry is not None and is_complete(out, entry, command):
            print(f"{variant}: complete, skipped", file=sys.stderr, flush=True)
            index["variants"][variant] = entry
            continue
        print(f"{variant}: {command}", file=sys.stderr, flush=True)
        rows, seconds = generate(out, variant, cmd)
        index["variants"][variant] = {
            "variant": variant,
            **describe(variant, size_mb, seq_len),
            "ranks": ranks,
            "files_per_save": ranks + 1,
            "steps": [int(r["step"]) for r in rows],
            "bytes_per_save": {str(int(r["step"])): int(r["bytes"]) for r in rows},
            "saves": rows,
            "command": command,
            "torch": index["torch"],
            "generated_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"),
            "generation_seconds": round(seconds, 1),
        }
        tmp = index_path.with_suffix(".tmp")  # after every variant: a crash keeps the rest
        tmp.write_text(json.dumps(index, indent=1) + "\n")
        tmp.replace(index_path)
    index_path.write_text(json.dumps(index, indent=1) + "\n")
    for name, v in index["variants"].items():
        mb = max(v["bytes_per_save"].values()) / 1e6
        print(
            f"{name}: {v['params']:,} params {v['dtype']}, {mb:,.0f} MB/save x "
            f"{len(v['steps'])} saves, {v['ranks']} ranks, {v['generation_seconds']:.0f}s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
