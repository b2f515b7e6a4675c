#!/usr/bin/env python3
"""PyTorch DDP peer of `cargo bench --bench overlap`: one rank of a data-parallel job (gloo,
env:// rendezvous from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) training a torchvision model
on random images, timing its steps with DDP's exchange (buckets reduced as the backward
produces them: DDP's own overlap) and without any (`no_sync()`), alternating, after warm-up.

Rank 0 prints `peer step_s=A compute_s=B`: the median step with the exchange and without it.
Usage: torch_ddp_exchange.py --model resnet50 --size 128 --batch-size 8 --steps 8 --warmup 2 --threads 1
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torchvision


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet50")
    p.add_argument("--size", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--steps", type=int, default=8, help="of each kind, after warm-up")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = getattr(torchvision.models, a.model)(num_classes=a.classes)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=a.bucket_mb)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    x = torch.randn(a.batch_size, 3, a.size, a.size)
    y = torch.arange(a.batch_size) % a.classes

    def step(exchange):
        opt.zero_grad(set_to_none=True)
        start = time.perf_counter()
        if exchange:
            loss_fn(ddp(x), y).backward()
        else:
            with ddp.no_sync():
                loss_fn(ddp(x), y).backward()
        opt.step()
        return time.perf_counter() - start

    for _ in range(a.warmup):
        step(True)
    with_exchange, without = [], []
    for _ in range(a.steps):
        with_exchange.append(step(True))
        without.append(step(False))
    # Every rank runs the same collectives (the ones in the steps with the exchange).
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"peer step_s={statistics.median(with_exchange):.4f} "
              f"compute_s={statistics.median(without):.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
