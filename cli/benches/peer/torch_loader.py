#!/usr/bin/env python3
"""torchvision peer of `hearth bench loader`: ImageFolder + DataLoader with the same workers,
batch size and training augmentation (RandomResizedCrop, RandomHorizontalFlip, with
`--auto-augment` torchvision's RandAugment, TrivialAugmentWide or AugMix, ToTensor, Normalize).
Prints
`peer images_per_s=X peak_rss_mb=Y`.
"""
import argparse
import resource
import time

import torch
from torchvision import datasets, transforms


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--auto-augment", default=None,
                   help="rand-mM-nN (RandAugment), trivialaugment or augmix-mS-wW-dD-aA, as Hearth "
                        "spells them")
    a = p.parse_args()
    policy = []
    if a.auto_augment == "trivialaugment":
        policy = [transforms.TrivialAugmentWide()]
    elif a.auto_augment and a.auto_augment.startswith("augmix"):
        # Hearth's Display form: augmix-m<severity>-w<width>-d<depth>-a<alpha>; its depth 0 is
        # torchvision's -1 (1 to 3 operations per chain). Hearth samples geometric operations at
        # the nearest pixel, so the peer does too (torchvision's AugMix defaults to bilinear).
        parts = dict((s[0], s[1:]) for s in a.auto_augment.split("-")[1:])
        depth = int(parts["d"])
        policy = [transforms.AugMix(severity=int(parts["m"]), mixture_width=int(parts["w"]),
                                    chain_depth=depth if depth > 0 else -1,
                                    alpha=float(parts["a"]), all_ops=True,
                                    interpolation=transforms.InterpolationMode.NEAREST)]
    elif a.auto_augment:
        # Hearth's Display form: rand-m<M>-n<N>.
        parts = dict((s[0], int(s[1:])) for s in a.auto_augment.split("-")[1:])
        policy = [transforms.RandAugment(num_ops=parts["n"], magnitude=parts["m"])]
    tf = transforms.Compose([
        transforms.RandomResizedCrop(a.size),
        transforms.RandomHorizontalFlip(),
        *policy,
        transforms.ToTensor(),
        transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
    ])
    ds = datasets.ImageFolder(a.data, transform=tf)
    dl = torch.utils.data.DataLoader(ds, batch_size=a.batch_size, shuffle=True, num_workers=a.workers,
                                     drop_last=True, persistent_workers=False)
    it = iter(dl)
    next(it)  # warm-up: worker start
    n = 0
    t = time.perf_counter()
    for _ in range(a.batches):
        try:
            x, _ = next(it)
        except StopIteration:
            it = iter(dl)
            x, _ = next(it)
        n += x.shape[0]
    dt = time.perf_counter() - t
    # Peak RSS of this process and its (finished or live) workers, in MB.
    rss = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss + resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 1024
    print(f"peer images_per_s={n / dt:.2f} peak_rss_mb={rss:.1f}")


if __name__ == "__main__":
    main()
