"""torch.distributed allreduce with the gloo backend: the peer of `hearth bench allreduce`.

    python benches/peer/gloo_allreduce.py --ranks 2 --size-mb 1 10 100 --iters 5 --warmup 2

Prints one line per size in the same format as Hearth:
size_mb=S time_ms=T algbw_GBps=A busbw_GBps=B
"""

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank, world, port, sizes, iters, warmup):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for mb in sizes:
        n = int(round(mb * 1e6 / 4))
        buf = torch.arange(n, dtype=torch.float32) % 97 + rank
        for _ in range(warmup):
            dist.all_reduce(buf)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(max(iters, 1)):
            dist.all_reduce(buf)
        secs = (time.perf_counter() - start) / max(iters, 1)
        algbw = n * 4 / secs / 1e9
        busbw = algbw * 2 * (world - 1) / world
        if rank == 0:
            size = int(mb) if float(mb).is_integer() else mb
            print(
                f"size_mb={size} time_ms={secs * 1e3:.3f} algbw_GBps={algbw:.3f} busbw_GBps={busbw:.3f}",
                flush=True,
            )
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--size-mb", type=float, nargs="+", default=[1, 10, 100])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    a = p.parse_args()
    mp.spawn(
        rank_main,
        args=(a.ranks, free_port(), a.size_mb, a.iters, a.warmup),
        nprocs=a.ranks,
        join=True,
    )


if __name__ == "__main__":
    main()
