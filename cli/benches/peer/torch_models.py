#!/usr/bin/env python3
"""PyTorch peer of `hearth bench model`: same model, batch, size and step counts, on CPU or CUDA.

Prints one line per config: `peer model=NAME mode=MODE batch=B images_per_s=X ...`, with
`first_step_s`, the seconds from this script's start (before torch is imported) to the end of its
first step: PyTorch's counterpart of a first run's kernel selection.
Usage: torch_models.py --model resnet50 --mode train --batch-size 16 --size 224 --steps 3 --warmup 1 [--device cuda]
"""
import time

T_START = time.perf_counter()

import argparse  # noqa: E402
import contextlib  # noqa: E402

import torch  # noqa: E402
import torchvision  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--mode", choices=["train", "infer"], required=True)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N)")
    p.add_argument("--channels-last", action="store_true", help="model and input in channels_last memory format")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="bf16/fp16: torch.autocast (fp16 training with GradScaler), f32 weights")
    a = p.parse_args()
    torch.manual_seed(0)
    dev = torch.device(a.device)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    model = getattr(torchvision.models, a.model)(num_classes=1000).to(dev)
    x = torch.randn(a.batch_size, 3, a.size, a.size, device=dev)
    if a.channels_last:
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    y = torch.arange(a.batch_size, device=dev) % 1000
    times = []
    first = None
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(a.precision)

    def autocast():
        if low is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=dev.type, dtype=low)

    scaler = torch.amp.GradScaler(dev.type) if a.precision == "fp16" else None
    if a.mode == "infer":
        model.eval()
        with torch.no_grad():
            for i in range(a.warmup + a.steps):
                sync()
                t = time.perf_counter()
                with autocast():
                    model(x)
                sync()
                if first is None:
                    first = time.perf_counter() - T_START
                if i >= a.warmup:
                    times.append(time.perf_counter() - t)
    else:
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        loss_fn = torch.nn.CrossEntropyLoss()
        for i in range(a.warmup + a.steps):
            sync()
            t = time.perf_counter()
            opt.zero_grad()
            with autocast():
                loss = loss_fn(model(x), y)
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            loss.item()
            sync()
            if first is None:
                first = time.perf_counter() - T_START
            if i >= a.warmup:
                times.append(time.perf_counter() - t)
    ips = a.steps * a.batch_size / sum(times)
    ordered = sorted(times)
    median = a.batch_size / ordered[len(ordered) // 2]
    best = a.batch_size / ordered[0]
    name = torch.cuda.get_device_name(dev).replace(" ", "_") if dev.type == "cuda" else "cpu"
    print(f"peer model={a.model} mode={a.mode} batch={a.batch_size} device={a.device} gpu={name} channels_last={int(a.channels_last)} precision={a.precision} threads={torch.get_num_threads()} images_per_s={ips:.3f} median_images_per_s={median:.3f} best_images_per_s={best:.3f} first_step_s={first:.2f}")


if __name__ == "__main__":
    main()
