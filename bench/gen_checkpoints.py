"""Series of successive training checkpoints, as realistic test data for delta compression.

Random bytes are the wrong test data for ckpt-ferry's deltas: successive real checkpoints
differ in small ways. Frozen tensors do not change at all, and tensors that do change keep
their sign, exponent and high mantissa bits from one save to the next. This script makes
such a series, each save a PyTorch DCP checkpoint directory (``.metadata`` +
``__0_0.distcp``) named by fine-tuning step::

    python -m bench.gen_checkpoints /tmp/ferry-series/torch-full --mode torch --variant full
    python -m bench.gen_checkpoints /tmp/s --mode synthetic --variant frozen --saves 4

writes ``OUT_DIR/step_000020/``, ``step_000040/``, ... and prints one ``key=value`` line per
save (step, bytes, seconds) on stdout; progress goes to stderr.

``--mode torch`` (the real thing; needs ``pip install torch==2.13.0``): a small byte-level
decoder-only transformer (8 pre-LN blocks), sized so that weights + AdamW state come to about
``--size-mb`` MiB, is pretrained on the CPython standard library's sources at a high learning
rate, then fine-tuned at ``--lr`` with a checkpoint every ``--save-every`` steps, saved with
``torch.distributed.checkpoint.save`` in a single process (no process group) and loaded back
to check it. Variants: ``full`` trains everything; ``frozen`` freezes the embeddings and all
but the last two blocks while fine-tuning (their weights and AdamW state stay bit-identical);
``bf16`` keeps weights and AdamW state in bfloat16 (pure bf16, as ``model.to(bfloat16)``
gives: at lr 3e-5 most weight updates round away, so ~87% of weights stay bit-identical).
Seeded: a rerun with the same arguments and thread count writes byte-identical ``*.distcp``
files (``.metadata`` holds a random save id).

``--ranks N`` writes every save as a real N-rank DCP layout instead, as N-way data-parallel
sharding (FSDP2) would: ``.metadata`` + ``__0_0.distcp`` .. ``__{N-1}_0.distcp``, each rank
file holding ~1/N of the weights and AdamW state. The model trains in this process; N worker
processes, started once, form a gloo process group on 127.0.0.1 with a 1-D CPU DeviceMesh.
Per save, this process writes a single-rank save to a temporary directory, every worker
``dcp.load``s its ``Shard(0)`` slices of it into DTensors (DCP reshards on load; tensors
with dim 0 < N stay ``Replicate``, AdamW's scalar ``step`` a plain tensor, as in FSDP2) and
all ``dcp.save`` the N-rank layout into the step directory; the temporary save is deleted
and the N-rank save is loaded back here and compared, every tensor, with ``torch.equal``.
Each worker holds only its shards (~1/N of the state, plus ~310 MiB of torch). For large
models on CPU: ``--fused`` uses the fused AdamW kernel (same algorithm, ~3x faster step
here) and ``--fp32-compute`` runs the bf16 variant's forward and backward in float32 from
the bf16 weights (gradients still reach AdamW in bf16): on a CPU without native bf16 matmul
(AVX2 only) a bf16 forward + backward was 5-10x slower than in float32.
``python -m bench.corpus`` uses all three.

``--mode synthetic`` (numpy only, seconds, for CI): the same tensor names and shapes, with
weights ~ N(0, 0.02) and AdamW state advanced by real AdamW steps on noisy gradients, written
in a DCP-like layout: ``__0_0.distcp`` holds the raw tensor bytes at fixed 64-byte-aligned
offsets (the same layout every save) and ``.metadata`` is JSON (names, dtypes, shapes,
offsets). Torch cannot load it: it only has the byte-level properties of the real thing. Its
gradient model (SIGNAL, PAST_GRAD2, gradient scales) was tuned until the deltas between saves
(relative change, equal leading bits and XOR+shuffle+zstd ratio of weights, exp_avg and
exp_avg_sq; see ``bench.ckpt_series_stats``) matched ``--mode torch`` at the defaults.

Save directories are named by fine-tuning step (pretraining steps are not counted).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import queue
import resource
import shutil
import socket
import sys
import sysconfig
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

MIB = 1 << 20
VOCAB = 256  # byte-level tokens: no tokenizer to ship or download
N_LAYERS = 8
TRAINABLE_BLOCKS = 2  # the frozen variant fine-tunes the last 2 blocks, ln_f and lm_head
HEAD_DIM = 64
BETAS = (0.9, 0.999)
EPS = 1e-8
WEIGHT_DECAY = 0.01
BLOCK = 16384  # synthetic AdamW: elements per cache-sized block
# Synthetic gradient model, tuned to match --mode torch's deltas (see the docstring):
SIGNAL = 0.1  # persistent gradient mean, relative to its noise
PAST_GRAD2 = 2.0  # pretraining gradients were larger: exp_avg_sq remembers them
ALIGN = 64  # synthetic layout: tensor data offsets, as torch.save aligns storages


# ---------------------------------------------------------------------------- model plan


@dataclasses.dataclass(frozen=True)
class ModelPlan:
    """Shape of the transformer; shared by both modes so they have the same tensors."""

    d_model: int
    d_ff: int
    n_layers: int
    seq_len: int
    vocab: int = VOCAB

    @property
    def n_heads(self) -> int:
        return max(1, self.d_model // HEAD_DIM)

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """Parameter names and shapes, in ``named_parameters()`` order of the torch model."""
        d, h = self.d_model, self.d_ff
        out: list[tuple[str, tuple[int, ...]]] = [
            ("tok_emb.weight", (self.vocab, d)),
            ("pos_emb.weight", (self.seq_len, d)),
        ]
        for i in range(self.n_layers):
            p = f"blocks.{i}."
            out += [(p + "ln1.weight", (d,)), (p + "ln1.bias", (d,))]
            for name in ("attn_q", "attn_k", "attn_v", "attn_o"):
                out += [(p + name + ".weight", (d, d)), (p + name + ".bias", (d,))]
            out += [(p + "ln2.weight", (d,)), (p + "ln2.bias", (d,))]
            out += [(p + "mlp_up.weight", (h, d)), (p + "mlp_up.bias", (h,))]
            out += [(p + "mlp_down.weight", (d, h)), (p + "mlp_down.bias", (d,))]
        out += [("ln_f.weight", (d,)), ("ln_f.bias", (d,)), ("lm_head.weight", (self.vocab, d))]
        return out

    def n_params(self) -> int:
        return sum(math.prod(s) for _, s in self.param_shapes())

    def is_frozen(self, name: str) -> bool:
        """Frozen in the ``frozen`` variant: embeddings and all but the last blocks."""
        if name.startswith(("tok_emb.", "pos_emb.")):
            return True
        if name.startswith("blocks."):
            return int(name.split(".")[1]) < self.n_layers - TRAINABLE_BLOCKS
        return False


def plan_model(size_mb: float, bytes_per_param: int, seq_len: int) -> ModelPlan:
    """Pick d_model (a multiple of 64) and d_ff so weights + AdamW state are ~size_mb MiB."""
    target = size_mb * MIB / bytes_per_param
    d = max(HEAD_DIM, round(math.sqrt(target / (12 * N_LAYERS)) / HEAD_DIM) * HEAD_DIM)
    outside = 2 * VOCAB * d + seq_len * d + 2 * d  # embeddings, lm_head, ln_f
    per_block = (target - outside) / N_LAYERS
    fixed = 4 * d * d + 4 * d + 4 * d + d  # attention + its biases, two LayerNorms, down bias
    d_ff = max(64, round((per_block - fixed) / (2 * d + 1) / 64) * 64)
    return ModelPlan(d_model=d, d_ff=d_ff, n_layers=N_LAYERS, seq_len=seq_len)


# ---------------------------------------------------------------------------- shared helpers


def step_dir(out_dir: Path, step: int) -> Path:
    return out_dir / f"step_{step:06d}"


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def report_save(step: int, path: Path, seconds: float, **extra: float) -> None:
    """The one stdout line per save: ``step=20 bytes=... seconds=...`` (+ extras)."""
    fields = [f"step={step}", f"bytes={dir_bytes(path)}", f"seconds={seconds:.3f}"]
    fields += [f"{k}={v:.4g}" for k, v in extra.items()]
    fields.append(f"dir={path}")
    print(" ".join(fields), flush=True)


def prepare_out_dir(out_dir: Path, steps: list[int], overwrite: bool) -> None:
    """Refuse to mix a new series into an old one unless asked to replace its saves."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for step in steps:
        d = step_dir(out_dir, step)
        if d.exists():
            if not overwrite:
                raise SystemExit(f"error: {d} exists (use --overwrite to replace it)")
            shutil.rmtree(d)


def load_corpus(max_bytes: int) -> bytes:
    """Real text: the CPython stdlib's *.py sources here (no site-packages), sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        (p for p in root.rglob("*.py") if not {"site-packages", "dist-packages"} & set(p.parts)),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    parts: list[bytes] = []
    total = 0
    for f in files:
        try:
            data = f.read_bytes()
        except OSError:
            continue
        parts.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    corpus = b"".join(parts)[:max_bytes]
    if len(corpus) < 1 << 16:
        raise SystemExit(f"error: found only {len(corpus)} bytes of Python sources under {root}")
    return corpus


# ---------------------------------------------------------------------------- torch mode


def build_model(plan: ModelPlan) -> torch.nn.Module:
    """Decoder-only transformer with separate q/k/v/o and MLP tensors, like real LLMs."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            d = plan.d_model
            self.ln1 = nn.LayerNorm(d)
            self.attn_q = nn.Linear(d, d)
            self.attn_k = nn.Linear(d, d)
            self.attn_v = nn.Linear(d, d)
            self.attn_o = nn.Linear(d, d)
            self.ln2 = nn.LayerNorm(d)
            self.mlp_up = nn.Linear(d, plan.d_ff)
            self.mlp_down = nn.Linear(plan.d_ff, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, d = x.shape
            y = self.ln1(x)
            q, k, v = (
                lin(y).view(b, t, plan.n_heads, -1).transpose(1, 2)
                for lin in (self.attn_q, self.attn_k, self.attn_v)
            )
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.attn_o(a.transpose(1, 2).reshape(b, t, d))
            out: torch.Tensor = x + self.mlp_down(F.gelu(self.mlp_up(self.ln2(x))))
            return out

    class TinyGPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            d = plan.d_model
            self.tok_emb = nn.Embedding(plan.vocab, d)
            self.pos_emb = nn.Embedding(plan.seq_len, d)
            self.blocks = nn.ModuleList(Block() for _ in range(plan.n_layers))
            self.ln_f = nn.LayerNorm(d)
            self.lm_head = nn.Linear(d, plan.vocab, bias=False)
            for m in self.modules():  # GPT-2 init: weights N(0, 0.02), biases 0
                if isinstance(m, nn.Linear | nn.Embedding):
                    nn.init.normal_(m.weight, std=0.02)
                if isinstance(m, nn.Linear) and m.bias is not None:
                    nn.init.zeros_(m.bias)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.tok_emb(idx) + self.pos_emb(pos)
            for block in self.blocks:
                x = block(x)
            logits: torch.Tensor = self.lm_head(self.ln_f(x))
            return logits

    model = TinyGPT()
    got = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    if got != plan.param_shapes():
        raise AssertionError("torch model and ModelPlan.param_shapes() disagree")
    return model


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_map_tensors(v, fn) for v in obj]
    return copy.deepcopy(obj)


def _tensor_leaves(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    import torch

    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensor_leaves(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _tensor_leaves(v, f"{prefix}.{i}")


def full_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd}


def dcp_save(state: dict[str, Any], path: Path) -> None:
    """DCP save in one process without a process group: ``.metadata`` + ``__0_0.distcp``."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    save(state, storage_writer=FileSystemWriter(str(path)))


def verify_load(state: dict[str, Any], path: Path) -> None:
    """Load the save at ``path`` into one process (any rank count) and compare every tensor."""
    import torch
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import load

    loaded = _map_tensors(state, torch.empty_like)
    load(loaded, storage_reader=FileSystemReader(str(path)))
    want = dict(_tensor_leaves(state))
    got = dict(_tensor_leaves(loaded))
    bad = [k for k, v in want.items() if k not in got or not torch.equal(v, got[k])]
    if bad or len(got) != len(want):
        raise SystemExit(f"error: {path} does not load back equal: {bad[:5]}")


def save_and_verify(model: torch.nn.Module, optim: torch.optim.Optimizer, path: Path) -> None:
    state = full_state(model, optim)
    dcp_save(state, path)
    verify_load(state, path)


# ---------------------------------------------------------------------------- N-rank saves


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A tensor's shape and dtype: what a worker needs to allocate its shard of it."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _rank_templates(spec: Any, mesh: Any, world: int) -> Any:
    """The state dict's structure with empty DTensors: Shard(0) where dim 0 >= world."""
    import torch
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor import empty as dtensor_empty

    if isinstance(spec, TensorSpec):
        if not spec.shape:  # AdamW's step: a plain (replicated) tensor, as FSDP2 keeps it
            return torch.empty((), dtype=spec.dtype)
        place = Shard(0) if spec.shape[0] >= world else Replicate()
        return dtensor_empty(spec.shape, dtype=spec.dtype, device_mesh=mesh, placements=[place])
    if isinstance(spec, dict):
        return {k: _rank_templates(v, mesh, world) for k, v in spec.items()}
    if isinstance(spec, list):
        return [_rank_templates(v, mesh, world) for v in spec]
    return copy.deepcopy(spec)


def _rank_worker(rank: int, world: int, port: int, jobs: Any, results: Any) -> None:
    """One rank: join the gloo group, then per job load its shards of a single-rank save
    and save them into the N-rank layout (every rank writes ``__{rank}_0.distcp``)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    warnings.filterwarnings("ignore", category=FutureWarning)
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.state_dict_loader import load
    from torch.distributed.checkpoint.state_dict_saver import save
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    mesh = init_device_mesh("cpu", (world,))
    while (job := jobs.get()) is not None:
        src, dst, spec = job
        try:
            t = time.perf_counter()
            state = _rank_templates(spec, mesh, world)
            load(state, storage_reader=FileSystemReader(src))
            save(state, storage_writer=FileSystemWriter(dst))
            del state
            peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            results.put((rank, None, time.perf_counter() - t, peak_mib))
        except BaseException:
            results.put((rank, traceback.format_exc(), 0.0, 0.0))
            raise
    dist.destroy_process_group()


class RankPool:
    """N worker processes forming a gloo process group on loopback, started once."""

    def __init__(self, world: int) -> None:
        import multiprocessing

        with socket.socket() as s:  # a free port for the TCP rendezvous (rank 0 listens)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = multiprocessing.get_context("spawn")
        self.world = world
        self.results = ctx.Queue()
        self.jobs = [ctx.Queue() for _ in range(world)]
        self.procs = [
            ctx.Process(target=_rank_worker, args=(r, world, port, self.jobs[r], self.results))
            for r in range(world)
        ]
        for proc in self.procs:
            proc.start()

    def reshard(self, src: Path, dst: Path, spec: Any) -> tuple[float, float]:
        """Every rank loads its shards of ``src`` and saves them to ``dst``; returns the
        slowest rank's seconds and the largest worker peak RSS (MiB) so far."""
        for q in self.jobs:
            q.put((str(src), str(dst), spec))
        seconds: list[float] = []
        peaks: list[float] = []
        while len(seconds) < self.world:
            try:
                rank, err, secs, peak = self.results.get(timeout=5)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                if dead:
                    self.close(kill=True)
                    raise SystemExit(f"error: rank workers {dead} died") from None
                continue
            if err is not None:
                self.close(kill=True)
                raise SystemExit(f"error: rank {rank} failed on {dst}:\n{err}")
            seconds.append(secs)
            peaks.append(peak)
        return max(seconds), max(peaks)

    def close(self, kill: bool = False) -> None:
        for proc, q in zip(self.procs, self.jobs, strict=True):
            if kill:
                proc.kill()
            elif proc.is_alive():
                q.put(None)
        for proc in self.procs:
            proc.join()


def save_ranks(
    model: torch.nn.Module, optim: torch.optim.Optimizer, path: Path, pool: RankPool
) -> dict[str, float]:
    """An N-rank DCP save of the current state at ``path``, verified against it."""
    state = full_state(model, optim)
    tmp = path.with_name(f".single-{path.name}")  # same filesystem, deleted below
    shutil.rmtree(tmp, ignore_errors=True)
    t = time.perf_counter()
    dcp_save(state, tmp)
    single_s = time.perf_counter() - t
    spec = _map_tensors(state, lambda x: TensorSpec(tuple(x.shape), x.dtype))
    try:
        reshard_s, worker_peak = pool.reshard(tmp, path, spec)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    want = {".metadata", *(f"__{r}_0.distcp" for r in range(pool.world))}
    got = {f.name for f in path.iterdir()}
    if got != want:
        raise SystemExit(f"error: {path} holds {sorted(got)}, expected {sorted(want)}")
    t = time.perf_counter()
    verify_load(state, path)
    verify_s = time.perf_counter() - t
    ranks = [(path / f"__{r}_0.distcp").stat().st_size for r in range(pool.world)]
    state_mib = sum(v.numel() * v.element_size() for _, v in _tensor_leaves(state)) / MIB
    log(
        f"{path.name}: {pool.world} rank files {min(ranks) / MIB:.1f}-{max(ranks) / MIB:.1f} "
        f"MiB; single-rank save {single_s:.1f}s, reshard {reshard_s:.1f}s, verify "
        f"{verify_s:.1f}s; worker peak RSS {worker_peak:.0f} MiB (state/N "
        f"{state_mib / pool.world:.0f} MiB)"
    )
    return {"single_seconds": single_s, "reshard_seconds": reshard_s, "verify_seconds": verify_s}


def run_torch(args: argparse.Namespace, steps: list[int]) -> None:
    pool = RankPool(args.ranks) if args.ranks > 1 else None  # starts while we train
    try:
        train_and_save(args, steps, pool)
    except BaseException:
        if pool is not None:
            pool.close(kill=True)
        raise
    if pool is not None:
        pool.close()


def train_and_save(args: argparse.Namespace, steps: list[int], pool: RankPool | None) -> None:
    import torch
    import torch.nn.functional as F
    from torch.func import functional_call

    # Single-process DCP warns that it assumes no process group; that is the intent here.
    warnings.filterwarnings("ignore", message=r".*torch\.distributed is disabled.*")

    torch.manual_seed(args.seed)
    dtype = torch.bfloat16 if args.variant == "bf16" else torch.float32
    # AdamW keeps exp_avg and exp_avg_sq in the weights' dtype: 3 copies of every weight.
    bytes_per_param = 3 * (2 if args.variant == "bf16" else 4)
    plan = plan_model(args.size_mb, bytes_per_param, args.seq_len)
    model = build_model(plan).to(dtype)
    n_params = plan.n_params()
    log(
        f"model: d_model={plan.d_model} d_ff={plan.d_ff} layers={plan.n_layers} "
        f"params={n_params:,} dtype={dtype} (~{bytes_per_param * n_params / MIB:.1f} MiB "
        f"with AdamW state); torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    corpus = load_corpus(int(args.corpus_mb * MIB))
    data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)
    log(f"corpus: {len(corpus):,} bytes of CPython stdlib sources")

    gen = torch.Generator().manual_seed(args.seed)
    optim = torch.optim.AdamW(
        model.parameters(),
        lr=args.warmup_lr,
        betas=BETAS,
        eps=EPS,
        weight_decay=WEIGHT_DECAY,
        fused=args.fused or None,
    )

    def train_step(lr: float) -> float:
        for group in optim.param_groups:
            group["lr"] = lr
        ix = torch.randint(0, len(data) - args.seq_len - 1, (args.batch_size,), generator=gen)
        xy = torch.stack([data[i : i + args.seq_len + 1] for i in ix.tolist()]).long()
        if args.fp32_compute and dtype != torch.float32:  # bf16 weights, float32 matmuls
            weights = {n: p.float() for n, p in model.named_parameters()}
            logits = functional_call(model, weights, (xy[:, :-1],))
        else:
            logits = model(xy[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, plan.vocab), xy[:, 1:].reshape(-1))
        optim.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        optim.step()
        return loss.item()

    # Pretraining: linear ramp, then cosine decay to 10% of the peak.
    t0 = time.perf_counter()
    ramp = max(1, args.warmup_steps // 10)
    loss = float("nan")
    for i in range(args.warmup_steps):
        if i < ramp:
            lr = args.warmup_lr * (i + 1) / ramp
        else:
            frac = (i - ramp) / max(1, args.warmup_steps - ramp)
            lr = args.warmup_lr * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))
        loss = train_step(lr)
        if (i + 1) % 25 == 0 or i + 1 == args.warmup_steps:
            log(
                f"pretrain {i + 1}/{args.warmup_steps} loss={loss:.3f} "
                f"({time.perf_counter() - t0:.0f}s)"
            )

    # Fine-tuning. Frozen params get no grads, so AdamW skips them: weights and state stay put.
    if args.variant == "frozen":
        frozen = [p for n, p in model.named_parameters() if plan.is_frozen(n)]
        for p in frozen:
            p.requires_grad_(False)
        frozen_n = sum(p.numel() for p in frozen)
        log(f"frozen: {frozen_n:,} of {n_params:,} params ({frozen_n / n_params:.0%})")
    optim.zero_grad(set_to_none=True)
    t_ft = time.perf_counter()
    for step in range(1, steps[-1] + 1):
        loss = train_step(args.lr)
        if step in steps:
            path = step_dir(args.out_dir, step)
            train_s = time.perf_counter() - t_ft
            t_save = time.perf_counter()
            extra: dict[str, float] = {}
            if pool is None:
                save_and_verify(model, optim, path)
            else:
                extra = save_ranks(model, optim, path, pool)
            save_s = time.perf_counter() - t_save
            report_save(step, path, save_s, train_seconds=train_s, loss=loss, **extra)
            t_ft = time.perf_counter()


# ---------------------------------------------------------------------------- synthetic mode


def round_to_bf16(x: np.ndarray) -> None:
    """Round float32 values in place to the nearest bfloat16 (ties to even); no NaNs here."""
    u = x.view(np.uint32)
    bias = ((u >> 16) & 1) + np.uint32(0x7FFF)
    u += bias
    u &= np.uint32(0xFFFF0000)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """The top 16 bits of float32 values that are already bfloat16-representable."""
    return (x.view(np.uint32) >> 16).astype(np.uint16)


@dataclasses.dataclass
class SyntheticState:
    """All weights, AdamW moments and the gradient model as flat float32 arrays.

    Gradients are ``mu + sigma * N(0, 1)`` per element: a persistent signal (mu) under noise
    of heavy-tailed scale (sigma, log-normal), which is what makes Adam's per-element steps
    look like a real run's. ``t0`` counts trainable elements from the start; the frozen
    variant updates only the suffix ``[t0:]`` (its tensors are the last in plan order).
    """

    plan: ModelPlan
    offsets: dict[str, tuple[int, int]]  # name -> (start, end) in the flat arrays
    p: np.ndarray
    m: np.ndarray
    v: np.ndarray
    mu: np.ndarray
    sigma: np.ndarray
    t0: int
    step: int


def init_synthetic(plan: ModelPlan, variant: str, seed: int, pretrain_steps: int) -> SyntheticState:
    rng = np.random.default_rng(seed)
    offsets: dict[str, tuple[int, int]] = {}
    pos = 0
    for name, shape in plan.param_shapes():
        offsets[name] = (pos, pos + math.prod(shape))
        pos += math.prod(shape)
    n = pos
    p = np.empty(n, np.float32)
    sigma = np.empty(n, np.float32)
    for name, (a, b) in offsets.items():
        if ".ln" in name or name.startswith("ln_f"):
            base = 1.0 if name.endswith(".weight") else 0.0
            p[a:b] = base + rng.normal(0.0, 0.02, b - a)  # trained LayerNorms drift off 1 / 0
        elif name.endswith(".bias"):
            p[a:b] = rng.normal(0.0, 0.005, b - a)
        else:
            p[a:b] = rng.normal(0.0, 0.02, b - a)
        tensor_scale = 10.0 ** rng.uniform(-5.5, -3.0)  # as torch mode: 1e-5.5 .. 1e-3
        sigma[a:b] = tensor_scale * np.exp(rng.normal(0.0, 0.5, b - a))
    mu = (SIGNAL * sigma * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)
    # AdamW state after `pretrain_steps` steps from zero: near-stationary first moment;
    # second moment still carrying its bias (1 - beta2^t) and earlier, larger gradients.
    m = (mu + 0.23 * sigma * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)
    g2 = (mu * mu + sigma * sigma) * np.exp(rng.normal(0.0, 0.5, n)).astype(np.float32)
    v = ((1 - BETAS[1] ** pretrain_steps) * PAST_GRAD2 * g2).astype(np.float32)
    if variant == "bf16":
        for arr in (p, m, v):
            round_to_bf16(arr)
    t0 = 0
    if variant == "frozen":
        t0 = min(a for name, (a, _) in offsets.items() if not plan.is_frozen(name))
        assert all(plan.is_frozen(nm) == (b <= t0) for nm, (_, b) in offsets.items())
    return SyntheticState(plan, offsets, p, m, v, mu, sigma, t0, pretrain_steps)


def _adamw_block(
    arrays: tuple[np.ndarray, ...],
    rng: np.random.Generator,
    first_step: int,
    k: int,
    lr: float,
    bf16: bool,
) -> None:
    """k AdamW steps (PyTorch's formula) on one cache-sized block of elements."""
    p, m, v, mu, sigma = arrays
    b1, b2 = BETAS
    g = np.empty_like(p)
    tmp = np.empty_like(p)
    for step in range(first_step + 1, first_step + k + 1):
        rng.standard_normal(out=g, dtype=np.float32)
        g *= sigma
        g += mu
        m *= np.float32(b1)
        m += np.float32(1 - b1) * g
        v *= np.float32(b2)
        np.multiply(g, g, out=tmp)
        tmp *= np.float32(1 - b2)
        v += tmp
        p *= np.float32(1 - lr * WEIGHT_DECAY)
        np.multiply(v, np.float32(1 / (1 - b2**step)), out=tmp)
        np.sqrt(tmp, out=tmp)
        tmp += np.float32(EPS)
        np.divide(m, tmp, out=tmp)
        tmp *= np.float32(lr / (1 - b1**step))
        p -= tmp
        if bf16:  # pure-bf16 training: every stored value is rounded after each step
            for arr in (p, m, v):
                round_to_bf16(arr)


def synthetic_steps(
    st: SyntheticState, k: int, lr: float, seed: tuple[int, ...], bf16: bool
) -> None:
    """k AdamW steps on the trainable suffix of the flat arrays.

    Elements are independent, so all k steps run on one cache-sized block before the next,
    on a few threads (numpy releases the GIL). Each block draws its gradient noise from
    its own seeded generator, so the result does not depend on thread scheduling.
    """
    starts = range(st.t0, len(st.p), BLOCK)

    def work(i: int, a: int) -> None:
        sl = slice(a, min(a + BLOCK, len(st.p)))
        arrays = (st.p[sl], st.m[sl], st.v[sl], st.mu[sl], st.sigma[sl])
        _adamw_block(arrays, np.random.default_rng([*seed, i]), st.step, k, lr, bf16)

    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        list(pool.map(work, range(len(starts)), starts))
    st.step += k


def synthetic_layout(st: SyntheticState, bf16: bool) -> list[dict[str, Any]]:
    """Fixed file layout: model weights, then per-param AdamW state, like DCP's order."""
    dtype = "bfloat16" if bf16 else "float32"
    shapes = st.plan.param_shapes()
    # (key in the file, dtype, shape, source array, parameter it belongs to)
    entries = [(f"model.{n}", dtype, s, "p", n) for n, s in shapes]
    for n, s in shapes:
        entries += [
            (f"optim.state.{n}.exp_avg", dtype, s, "m", n),
            (f"optim.state.{n}.exp_avg_sq", dtype, s, "v", n),
            (f"optim.state.{n}.step", "float32", (), "step", n),
        ]
    out: list[dict[str, Any]] = []
    pos = 0
    for key, dt, shape, src, param in entries:
        nbytes = (2 if dt == "bfloat16" else 4) * math.prod(shape)
        out.append(
            {
                "name": key,
                "dtype": dt,
                "shape": list(shape),
                "offset": pos,
                "nbytes": nbytes,
                "src": src,
                "param": param,
            }
        )
        pos = -(-(pos + nbytes) // ALIGN) * ALIGN
    return out


def write_synthetic(
    st: SyntheticState, path: Path, args: argparse.Namespace, frozen_steps: dict[str, int]
) -> None:
    """Write ``__0_0.distcp`` (raw bytes at fixed offsets) and a JSON ``.metadata``."""
    bf16 = args.variant == "bf16"
    layout = synthetic_layout(st, bf16)
    end = layout[-1]["offset"] + layout[-1]["nbytes"]
    buf = np.zeros(end, np.uint8)
    arrays = {"p": st.p, "m": st.m, "v": st.v}
    for e in layout:
        a, b = st.offsets[e["param"]]
        if e["src"] == "step":
            step = frozen_steps.get(e["param"], st.step)
            raw = np.array([step], np.float32).view(np.uint8)
        elif e["dtype"] == "bfloat16":
            raw = bf16_bits(arrays[e["src"]][a:b]).view(np.uint8)
        else:
            raw = arrays[e["src"]][a:b].view(np.uint8)
        buf[e["offset"] : e["offset"] + e["nbytes"]] = raw
    path.mkdir(parents=True)
    buf.tofile(path / "__0_0.distcp")
    meta = {
        "format": "ckpt-ferry synthetic DCP-like checkpoint (not loadable by torch)",
        "variant": args.variant,
        "step": st.step,
        "param_groups": [
            {"lr": args.lr, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY}
        ],
        "tensors": [
            {k: e[k] for k in ("name", "dtype", "shape", "offset", "nbytes")} for e in layout
        ],
        "file": "__0_0.distcp",
    }
    (path / ".metadata").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")


def run_synthetic(args: argparse.Namespace, steps: list[int]) -> None:
    bf16 = args.variant == "bf16"
    plan = plan_model(args.size_mb, 3 * (2 if bf16 else 4), args.seq_len)
    t = time.perf_counter()
    st = init_synthetic(plan, args.variant, args.seed, args.warmup_steps)
    n = plan.n_params()
    log(f"synthetic: {n:,} params, {n - st.t0:,} trainable, init {time.perf_counter() - t:.1f}s")
    # Frozen params' AdamW step counters stop at the end of pretraining.
    frozen_steps = {name: st.step for name in st.offsets if st.t0 and plan.is_frozen(name)}
    done = 0
    for step in steps:
        t = time.perf_counter()
        synthetic_steps(st, step - done, args.lr, (args.seed, 1, step), bf16)
        done = step
        train_s = time.perf_counter() - t
        path = step_dir(args.out_dir, step)
        t = time.perf_counter()
        write_synthetic(st, path, args, frozen_steps)
        report_save(step, path, time.perf_counter() - t, train_seconds=train_s)


# ---------------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.gen_checkpoints",
        description="Write a series of successive DCP checkpoints (fine-tuning-like).",
    )
    ap.add_argument("out_dir", type=Path, metavar="OUT_DIR")
    ap.add_argument("--mode", choices=("torch", "synthetic"), required=True)
    ap.add_argument("--variant", choices=("full", "frozen", "bf16"), required=True)
    ap.add_argument("--saves", type=int, default=4, help="checkpoints to write (default 4)")
    ap.add_argument("--save-every", type=int, default=20, help="fine-tuning steps between saves")
    ap.add_argument("--lr", type=float, default=3e-5, help="fine-tuning learning rate")
    ap.add_argument(
        "--size-mb", type=float, default=64.0, help="weights + AdamW state, MiB (default 64)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--warmup-steps",
        type=int,
        default=150,
        help="pretraining steps before fine-tuning (synthetic: AdamW bias age)",
    )
    ap.add_argument("--warmup-lr", type=float, default=1e-3, help="peak pretraining lr")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument(
        "--corpus-mb",
        type=float,
        default=4.0,
        help="MiB of stdlib sources to train on (torch mode)",
    )
    ap.add_argument(
        "--ranks",
        type=int,
        default=1,
        help="torch: write each save as an N-rank DCP layout (gloo workers, DTensor Shard(0))",
    )
    ap.add_argument("--fused", action="store_true", help="torch: fused AdamW kernel")
    ap.add_argument(
        "--fp32-compute",
        action="store_true",
        help="torch bf16: forward/backward in float32 from the bf16 weights",
    )
    ap.add_argument("--overwrite", action="store_true", help="replace existing step_* dirs")
    args = ap.parse_args(argv)
    if args.saves < 1 or args.save_every < 1 or args.size_mb <= 0 or args.warmup_steps < 0:
        ap.error("--saves, --save-every and --size-mb must be positive, --warmup-steps >= 0")
    if args.ranks < 1 or (args.ranks > 1 and args.mode != "torch"):
        ap.error("--ranks must be >= 1, and > 1 only with --mode torch")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    steps = [args.save_every * (i + 1) for i in range(args.saves)]
    if args.mode == "torch":
        try:  # checked before touching OUT_DIR, so a missing torch leaves nothing behind
            import torch  # noqa: F401
        except ImportError:
            print(
                "error: --mode torch needs PyTorch, which is not installed. Install the CPU "
                "build with `pip install torch==2.13.0`, or use --mode synthetic (numpy only).",
                file=sys.stderr,
            )
            return 2
    prepare_out_dir(args.out_dir, steps, args.overwrite)
    t = time.perf_counter()
    if args.mode == "torch":
        run_torch(args, steps)
    else:
        run_synthetic(args, steps)
    log(f"done: {len(steps)} saves in {args.out_dir} ({time.perf_counter() - t:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
