#!/usr/bin/env python3
"""Writes the torchvision parity fixtures under cli/tests/fixtures/parity/.

Each fixture is a small network built from torchvision's own classes and blocks, with random
weights AND random batch-norm statistics (so a mis-loaded statistic shows), its state_dict,
a fixed input and torchvision's logits in eval mode. The Rust tests (cli/tests/parity.rs) load the
weights through Hearth's real loaders and must match the logits within 1e-4.

Sizes: full-width torchvision ResNets/VGGs are 20-500 MB, so
  * ResNets are torchvision.models.ResNet whose stem and stages are rebuilt narrower with
    torchvision's own `_make_layer` and blocks (the forward is torchvision's);
  * VGGs are torchvision.models.VGG over `make_layers` with a small config, with the classifier
    rebuilt as the same Linear/ReLU/Dropout sequence at hidden width 16 (keys classifier.0/3/6
    as in torchvision).

Run: python scripts/make_parity_fixtures.py   (needs torch + torchvision; see
scripts/setup_pytorch.sh)
"""
import json
import os
import struct
import sys

import numpy as np
import torch
from torch import nn
import torchvision
from torchvision.models import ResNet, DenseNet, VGG
from torchvision.models.resnet import BasicBlock, Bottleneck
from torchvision.models.vgg import make_layers

OUT = os.path.join(os.path.dirname(__file__), "..", "cli", "tests", "fixtures", "parity")


def randomize(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=g) * (2.0 / fan_in) ** 0.5)
            elif name.endswith("weight"):  # batch norm gamma
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            else:  # biases, beta
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("running_mean"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
            elif name.endswith("running_var"):
                b.copy_(torch.rand(b.shape, generator=g) + 0.5)


def narrow_resnet(block, layers, stem, widths, num_classes):
    m = ResNet(block, layers, num_classes=num_classes)
    # Rebuild the stem and stages narrower with torchvision's own code.
    m.inplanes = stem
    m.conv1 = nn.Conv2d(3, stem, kernel_size=7, stride=2, padding=3, bias=False)
    m.bn1 = nn.BatchNorm2d(stem)
    m.layer1 = m._make_layer(block, widths[0], layers[0])
    m.layer2 = m._make_layer(block, widths[1], layers[1], stride=2)
    m.layer3 = m._make_layer(block, widths[2], layers[2], stride=2)
    m.layer4 = m._make_layer(block, widths[3], layers[3], stride=2)
    m.fc = nn.Linear(widths[3] * block.expansion, num_classes)
    return m


def small_vgg(cfg, batch_norm, hidden, num_classes):
    m = VGG(make_layers(cfg, batch_norm=batch_norm), num_classes=num_classes)
    last = [c for c in cfg if c != "M"][-1]
    m.classifier = nn.Sequential(
        nn.Linear(last * 7 * 7, hidden),
        nn.ReLU(True),
        nn.Dropout(),
        nn.Linear(hidden, hidden),
        nn.ReLU(True),
        nn.Dropout(),
        nn.Linear(hidden, num_classes),
    )
    return m


def save_npy(path, array):
    np.save(path, np.ascontiguousarray(array, dtype=np.float32))


def save_safetensors(path, state_dict):
    """SafeTensors writer (format: u64 header size, JSON header, raw little-endian data)."""
    header, blobs, offset = {}, [], 0
    for key, t in state_dict.items():
        if key.endswith("num_batches_tracked"):
            continue
        data = t.detach().contiguous().to(torch.float32).numpy().astype("<f4").tobytes()
        header[key] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * ((8 - len(head) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for b in blobs:
            f.write(b)


FIXTURES = [
    # name, builder, input shape, formats
    ("resnet_basic", lambda: narrow_resnet(BasicBlock, [1, 1, 1, 1], 16, [16, 32, 64, 128], 10), (2, 3, 40, 32), ["pth"]),
    ("resnet_bottleneck", lambda: narrow_resnet(Bottleneck, [2, 1, 1, 1], 16, [8, 16, 32, 64], 7), (2, 3, 32, 32), ["pth"]),
    ("densenet", lambda: DenseNet(growth_rate=8, block_config=(2, 2, 2, 2), num_init_features=16, num_classes=5), (2, 3, 32, 32), ["pth", "safetensors"]),
    ("vgg_bn", lambda: small_vgg([8, "M", 16, "M", 32, 32, "M"], True, 16, 6), (2, 3, 32, 32), ["pth"]),
    ("vgg", lambda: small_vgg([8, "M", 16, "M", 16, "M", 32, "M", 32, "M"], False, 16, 4), (2, 3, 32, 32), ["safetensors"]),
]


def main():
    os.makedirs(OUT, exist_ok=True)
    torch.manual_seed(0)
    manifest = {"torch": torch.__version__, "torchvision": torchvision.__version__, "fixtures": {}}
    for i, (name, build, shape, formats) in enumerate(FIXTURES):
        model = build()
        randomize(model, 1000 + i)
        model.eval()
        x = torch.randn(shape, generator=torch.Generator().manual_seed(2000 + i))
        with torch.no_grad():
            y = model(x)
        sd = model.state_dict()
        for fmt in formats:
            if fmt == "pth":
                torch.save(sd, os.path.join(OUT, f"{name}.pth"))
            else:
                save_safetensors(os.path.join(OUT, f"{name}.safetensors"), sd)
        save_npy(os.path.join(OUT, f"{name}_input.npy"), x.numpy())
        save_npy(os.path.join(OUT, f"{name}_logits.npy"), y.numpy())
        params = sum(p.numel() for p in model.parameters())
        manifest["fixtures"][name] = {"params": params, "input": list(shape), "logits": list(y.shape), "formats": formats}
        print(f"{name}: {params} params, input {list(shape)}, logits {list(y.shape)}")
    with open(os.path.join(OUT, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2)
    total = sum(os.path.getsize(os.path.join(OUT, f)) for f in os.listdir(OUT))
    print(f"total fixture size: {total / 1e6:.2f} MB")
    if total > 16e6:
        sys.exit("fixtures exceed 16 MB")


if __name__ == "__main__":
    main()
