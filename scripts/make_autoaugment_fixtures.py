#!/usr/bin/env python3
"""Writes datasets/tests/fixtures/autoaugment.txt: torchvision's RandAugment and
TrivialAugmentWide operations on one small 8-bit image, for the Rust tests in
datasets/src/autoaugment/tests.rs.

Lines (text, one record per line):
  image W H HEX                       the input, HWC bytes as hex
  space POLICY OP SIGNED V0 ... V30   torchvision's magnitude table (POLICY rand or wide)
  op POLICY OP BIN SIGN M HEX         _apply_op(image, OP, M) where M = SIGN * table[BIN]

Each operation runs through torchvision's own `_apply_op` on a uint8 tensor (the tensor path,
nearest sampling, fill None), as RandAugment and TrivialAugmentWide call it.

Run: ~/.cache/hearth/venv-torch/bin/python scripts/make_autoaugment_fixtures.py
(scripts/setup_pytorch.sh makes that environment).
"""
import os

import torch
import torchvision
from torchvision.transforms import InterpolationMode
from torchvision.transforms.autoaugment import RandAugment, TrivialAugmentWide, _apply_op

W, H = 16, 12
OUT = os.path.join(os.path.dirname(__file__), "..", "datasets", "tests", "fixtures", "autoaugment.txt")


def image():
    """Gradients and a few speckles over a middle range, so every operation changes it."""
    g = torch.Generator().manual_seed(7)
    y = torch.arange(H).view(H, 1).expand(H, W)
    x = torch.arange(W).view(1, W).expand(H, W)
    r = 40 + 9 * x + 3 * y
    gr = 60 + 11 * y + 2 * x
    b = 90 + 5 * ((x * y) % 17)
    img = torch.stack([r, gr, b]).clamp(0, 255).to(torch.uint8)
    noise = torch.randint(0, 25, (3, H, W), generator=g).to(torch.uint8)
    return img + noise


def hexbytes(chw):
    return chw.permute(1, 2, 0).contiguous().numpy().tobytes().hex()


def main():
    img = image()
    lines = [f"# torch {torch.__version__} torchvision {torchvision.__version__}",
             f"image {W} {H} {hexbytes(img)}"]
    policies = {
        "rand": (RandAugment()._augmentation_space(31, (H, W)), [9, 30]),
        "wide": (TrivialAugmentWide()._augmentation_space(31), [10, 30]),
    }
    for name, (space, bins) in policies.items():
        for op, (mags, signed) in space.items():
            values = [float(v) for v in mags.reshape(-1)] if mags.ndim > 0 else []
            lines.append(f"space {name} {op} {int(signed)} " + " ".join(repr(v) for v in values))
            for b in bins if values else [0]:
                for sign in ([1, -1] if signed else [1]):
                    m = sign * values[b] if values else 0.0
                    out = _apply_op(img, op, m, interpolation=InterpolationMode.NEAREST, fill=None)
                    lines.append(f"op {name} {op} {b} {sign} {m!r} {hexbytes(out)}")
    with open(OUT, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} lines to {OUT}")


if __name__ == "__main__":
    main()
