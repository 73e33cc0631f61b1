"""A PyTorch DDP training job (gloo, CPU) that checkpoints the way a real one should.

Launched by ``srun`` inside ``ddp.sbatch``: one task per node, rank and world size from
Slurm. Rank 0 saves model, optimizer and step atomically (temp file, then rename) every
``--checkpoint-every`` steps and on SIGTERM; every rank agrees on stopping through an
all-reduce, so a signal seen by one rank a step early cannot deadlock the others. On
start it loads the checkpoint and logs ``resumed from step N``. Rank 0 reports its
checkpoints to gpufleet (``gpufleet checkpoint-done``, at most every ``--report-every``
seconds: lab/jobs/report.py).

In the lab (``$GPUFLEET_LAB_FAULTS`` set) each rank looks at its node's GPU fault at every step
(lab/faults.py) and crashes or hangs with its GPU; the ranks on other nodes then wait in their
all-reduce, as in a real collective.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lab.faults import RankFaults
from lab.jobs.report import CheckpointReports


def save_checkpoint(path: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, tmp)
    os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=100000)
    parser.add_argument("--step-seconds", type=float, default=0.2)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--report-every", type=float, default=30.0, help="seconds between reports; 0: none")
    args = parser.parse_args()
    reports = CheckpointReports(args.report_every if int(os.environ["SLURM_PROCID"]) == 0 else 0)

    rank = int(os.environ["SLURM_PROCID"])
    world = int(os.environ["SLURM_NTASKS"])
    node = os.environ.get("SLURMD_NODENAME", "?")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(20000 + int(os.environ["SLURM_JOB_ID"]) % 20000))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)

    stopping = False

    def on_term(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    # gloo's all-reduce makes the other ranks wait for a rank that fails: no peers to watch.
    faults = RankFaults.from_env(wait_for_peers=False)

    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0
    if args.checkpoint.exists():
        state = torch.load(args.checkpoint, weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = int(state["step"])
        print(f"rank {rank} on {node}: resumed from step {step}", flush=True)
    else:
        print(f"rank {rank} on {node}: starting from scratch", flush=True)

    inputs = torch.randn(64, 16)
    target = inputs.sum(dim=1, keepdim=True)
    while step < args.steps:
        if faults is not None:
            faults.check(step)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(inputs), target)
        loss.backward()
        optimizer.step()
        step += 1
        stop = torch.tensor([1 if stopping else 0])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item():
            if rank == 0:
                save_checkpoint(args.checkpoint, model=model.module, optimizer=optimizer, step=step)
                print(f"SIGTERM: checkpoint saved at step {step}; exiting", flush=True)
            break
        if rank == 0 and step % args.checkpoint_every == 0:
            save_checkpoint(args.checkpoint, model=model.module, optimizer=optimizer, step=step)
            print(f"checkpoint saved at step {step} (loss {loss.item():.4f})", flush=True)
            reports.saved(step)
        time.sleep(args.step_seconds)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
