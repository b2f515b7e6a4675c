"""PyTorch's side of `cargo bench --bench memory`: DDP over gloo on N local processes, with
the plain optimizer or ZeroRedundancyOptimizer (PyTorch's ZeRO stage 1: each rank keeps 1/N of
the optimizer state), a torchvision model at 32x32, the same per-rank batch as Hearth's run.
Prints one JSON line per rank: its peak resident memory (ru_maxrss) and the mean step time.

    python torch_memory.py --model vgg16 --optimizer adam --ranks 2 --zero 1 --batch 2 --steps 8
"""

import argparse
import json
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torchvision


def run(rank, args, port, out):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    # The machine's cores shared among the ranks (torchrun's advice; one rank keeps them all).
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.ranks))
    torch.manual_seed(0)
    model = getattr(torchvision.models, args.model)(num_classes=3)
    ddp = torch.nn.parallel.DistributedDataParallel(model) if args.ranks > 1 else model
    kind = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[args.optimizer]
    kw = {"lr": 0.01, "momentum": 0.9} if args.optimizer == "sgd" else {"lr": 0.001}
    if args.zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=kind, **kw)
    else:
        opt = kind(ddp.parameters(), **kw)
    loss_fn = torch.nn.CrossEntropyLoss()
    x = torch.randn(args.batch, 3, args.size, args.size)
    y = torch.randint(0, 3, (args.batch,))
    times = []
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_fn(ddp(x), y).backward()
        opt.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    if args.ranks > 1:
        dist.barrier()
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    out.put(
        {
            "rank": rank,
            "peak_mb": peak_mb,
            "step_ms": 1000.0 * sum(times) / max(1, len(times)),
        }
    )
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet50")
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--zero", type=int, default=0)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=run, args=(r, args, port, out)) for r in range(args.ranks)]
    for proc in procs:
        proc.start()
    results = [out.get(timeout=1800) for _ in procs]
    for proc in procs:
        proc.join(timeout=60)
    for r in sorted(results, key=lambda r: r["rank"]):
        print(json.dumps(r))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
