#!/usr/bin/env python3
"""torchvision peer of `cargo bench --bench augment_ops`: each automatic-augmentation operation
through torchvision's `_apply_op` (what RandAugment, TrivialAugmentWide and AugMix call) on a
noisy RGB image, nearest sampling, timed over `--iters` calls. `--backend pil` takes the PIL
image `ImageFolder` yields (what the loader bench's peer runs), `tensor` a uint8 CHW tensor.
Prints `op=NAME us=X` per operation (microseconds per call).
"""
import argparse
import time

import numpy as np
import torch
from PIL import Image
from torchvision.transforms import InterpolationMode, autoaugment


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--backend", choices=["pil", "tensor"], default="pil")
    p.add_argument("--ops", required=True, help="NAME:MAGNITUDE,... as Hearth names them")
    a = p.parse_args()
    torch.set_num_threads(1)
    pixels = np.random.default_rng(7).integers(0, 256, (a.size, a.size, 3), dtype=np.uint8)
    img = Image.fromarray(pixels) if a.backend == "pil" else torch.from_numpy(pixels).permute(2, 0, 1).contiguous()
    for item in a.ops.split(","):
        name, magnitude = item.split(":")
        magnitude = float(magnitude)
        apply = lambda: autoaugment._apply_op(img, name, magnitude, InterpolationMode.NEAREST, None)
        apply()  # warm-up
        t = time.perf_counter()
        for _ in range(a.iters):
            apply()
        dt = time.perf_counter() - t
        print(f"op={name} us={dt / a.iters * 1e6:.1f}")


if __name__ == "__main__":
    main()
