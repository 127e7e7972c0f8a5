"""Context parallelism with JVP: an sCM/MeanFlow-style training step of a small transformer
whose sequence is split across the ranks, with flash_jvp.distributed.

    torchrun --nproc-per-node 2 examples/context_parallel.py                # CUDA, NCCL
    torchrun --nproc-per-node 2 examples/context_parallel.py --device cpu   # CPU, gloo

Each rank holds its chunk of the sequence; the model is unchanged (its attention calls
F.scaled_dot_product_attention); ``context_parallel_sdpa`` turns those calls into ring (or
Ulysses) attention over the ranks, with the JVP's tangents travelling with q, k and v. The
parameters' gradients are summed over the ranks (each rank's loss covers its own tokens). At
the end rank 0 runs the same step on the whole sequence alone and prints the differences.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import flash_jvp
from flash_jvp.distributed import context_parallel_sdpa, shard_sequence


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):  # (B, L, dim): L is this rank's chunk under context parallelism
        q, k, v = self.qkv(self.norm1(x)).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(o.transpose(1, 2).flatten(2))
        return x + self.mlp(self.norm2(x))


def training_step(model, x, x_t, target):
    """pred and its directional derivative along x_t in one pass; a loss on pred and the
    detached tangent (as sCM/MeanFlow do); the backward through pred."""
    pred, dpred = torch.func.jvp(model, (x,), (x_t,))
    loss = ((pred - target) ** 2).sum() + (pred * dpred.detach()).sum()
    loss.backward()
    return pred.detach(), dpred.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--method", choices=["ring", "ulysses"], default="ring")
    parser.add_argument("--length", type=int, default=1024, help="global sequence length")
    args = parser.parse_args()

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, device = dist.get_rank(), torch.device(args.device)
    dtype = torch.float32  # fp32 weights; on CUDA the step runs under bf16 autocast

    torch.manual_seed(0)  # the same weights and data on every rank
    model = nn.Sequential(*(Block(256, 8) for _ in range(2))).to(device, dtype)
    x, x_t, target = (torch.randn(2, args.length, 256, device=device) for _ in range(3))

    # this rank's chunk of the sequence (dim 1); the model sees only its chunk
    local = [shard_sequence(t, 1) for t in (x, x_t, target)]
    with (
        context_parallel_sdpa(method=args.method),
        torch.autocast(args.device, torch.bfloat16, enabled=cuda),
    ):
        pred, dpred = training_step(model, *local)
    for p in model.parameters():  # each rank's gradient covers its own tokens
        dist.all_reduce(p.grad)

    # the whole sequence on one rank, for comparison
    pred_all, dpred_all = ([torch.empty_like(t) for _ in range(dist.get_world_size())]
                           for t in (pred, dpred))  # fmt: skip
    dist.all_gather(pred_all, pred)
    dist.all_gather(dpred_all, dpred)
    if rank == 0:
        single = nn.Sequential(*(Block(256, 8) for _ in range(2))).to(device, dtype)
        single.load_state_dict(model.state_dict())
        with flash_jvp.patch_sdpa(), torch.autocast(args.device, torch.bfloat16, enabled=cuda):
            ref_pred, ref_dpred = training_step(single, x, x_t, target)
        grad_err = max(
            ((p.grad - r.grad).norm() / r.grad.norm()).item()
            for p, r in zip(model.parameters(), single.parameters())
        )
        for name, ours, ref in (("pred", pred_all, ref_pred), ("dpred", dpred_all, ref_dpred)):
            err = ((torch.cat(ours, 1) - ref).norm() / ref.norm()).item()
            print(f"{args.method}, {dist.get_world_size()} ranks: {name} rel. difference {err:.1e}")
        print(f"{args.method}: largest parameter-gradient rel. difference {grad_err:.1e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
