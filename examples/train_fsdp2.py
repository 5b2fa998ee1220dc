"""A plain FSDP2 training script with ckptool's Checkpointer: save, retention, resume.

Copy the marked lines into your own script. Run on CPU (gloo) or GPUs (nccl):

    torchrun --nproc_per_node=2 examples/train_fsdp2.py --out /tmp/example_run --steps 20
    torchrun --nproc_per_node=2 examples/train_fsdp2.py --out /tmp/example_run --steps 40  # resumes at 20
    torchrun --nproc_per_node=1 examples/train_fsdp2.py --out /tmp/example_run --steps 60  # other rank count

Checkpoints land in OUT/step_N/ (DCP: keys model.*, optim.*, lr_scheduler.*, train.*), each
with a ckptool.json manifest; check one with 'ckptool validate OUT/step_N'.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ckptool import Checkpointer


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Net(nn.Module):
    def __init__(self, d: int = 32, n_blocks: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_blocks))
        self.out = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


class Progress:
    """Anything with state_dict/load_state_dict is saved and restored by DCP ("Stateful")."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


def batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    # The global batch depends on the step only, so a run can resume at another rank count.
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 8, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    rows = 16 // world_size
    return x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/example_run")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--async-save", action="store_true")
    args = p.parse_args()

    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if gpu else "gloo")
    rank, ws = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    model = Net()
    mesh = init_device_mesh("cuda" if gpu else "cpu", (ws,))  # always pass an explicit mesh
    for block in model.blocks:  # each block is its own FSDP unit, then the root
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
    progress = Progress()

    # --- ckptool: create, resume (on every rank) ----------------------------------------
    ckpt = Checkpointer(args.out, keep=2, async_save=args.async_save)
    extra = {"lr_scheduler": scheduler, "train": progress}
    resumed = ckpt.load_latest(model, optimizer, extra=extra)
    if rank == 0:
        print(f"resumed from step {resumed}" if resumed is not None else "fresh start", flush=True)
    # -------------------------------------------------------------------------------------

    device = "cuda" if gpu else "cpu"
    for step in range(progress.step + 1, args.steps + 1):
        x, y = batch(step, rank, ws)
        loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        progress.step = step
        # --- ckptool: save every K steps (on every rank) ----------------------------------
        if step % args.save_every == 0 or step == args.steps:
            ckpt.save(step, model, optimizer, extra=extra, loss=loss.item())
        # ---------------------------------------------------------------------------------
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)

    ckpt.close()  # waits for an async save in flight; call it on every rank
    if rank == 0:
        print(f"checkpoints: {[c.name for c in ckpt.list() if c.committed]}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":  # required: DCP's async-save process re-imports this file
    main()
