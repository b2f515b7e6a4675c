#!/usr/bin/env python3
"""PyTorch peer of `cargo bench --bench recipe`: trains the same small ResNet with the same
recipe on the same image folder and prints what Hearth prints.

Model: torchvision's ResNet with BasicBlock, one block per stage, stem 16, widths 16-128 (Hearth's
`resnet-mini`). Recipe: SGD momentum 0.9, weight decay on weights only (not biases or batch
norm), linear warmup over the first epoch then cosine to zero (per optimizer step), batch 32,
cross-entropy. Augmentation presets as Hearth's `--augment`:
  none     = Resize(size*256/224) + CenterCrop(size)
  light    = RandomResizedCrop(size, scale=(0.7, 1.0)) + RandomHorizontalFlip()
  imagenet = RandomResizedCrop(size) + RandomHorizontalFlip()
  timm     = light + RandAugment(2, 9) + RandomErasing(0.25, value 0 after normalising),
             MixUp(0.2) or CutMix(1.0) per batch (switch probability 0.5), label smoothing
             0.1, gradient clipping to norm 1.0, an EMA of weights and buffers (decay 0.99)
             validated each epoch, on torchvision's resnet18 (timm's train.py flags
             --aa rand-m9-n2 --reprob 0.25 --remode const --mixup 0.2 --cutmix 1.0
             --smoothing 0.1 --clip-grad 1.0 --model-ema --model-ema-decay 0.99)
Validation: Resize(size*256/224) + CenterCrop(size). All ImageNet-normalised.

Prints: `peer preset=P epochs=E train_acc=X best_val_acc=Y best_epoch=B seconds=T`, and for
`timm` also `best_ema_val_acc=Z`.
"""
import argparse
import math
import time

import torch
import torch.nn as nn
import torchvision
from torchvision import transforms
from torchvision.models.resnet import BasicBlock, ResNet


def mini_resnet(num_classes):
    m = ResNet(BasicBlock, [1, 1, 1, 1], num_classes=num_classes)
    m.inplanes = 16
    m.conv1 = nn.Conv2d(3, 16, kernel_size=7, stride=2, padding=3, bias=False)
    m.bn1 = nn.BatchNorm2d(16)
    m.layer1 = m._make_layer(BasicBlock, 16, 1)
    m.layer2 = m._make_layer(BasicBlock, 32, 1, stride=2)
    m.layer3 = m._make_layer(BasicBlock, 64, 1, stride=2)
    m.layer4 = m._make_layer(BasicBlock, 128, 1, stride=2)
    m.fc = nn.Linear(128, num_classes)
    return m


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--preset", choices=["none", "light", "imagenet", "timm"], required=True)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    torch.manual_seed(a.seed)
    torch.set_num_threads(2)
    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    resize = round(a.size * 256 / 224)
    evaluation = [transforms.Resize(resize), transforms.CenterCrop(a.size)]
    train_tf = {
        "none": evaluation,
        "light": [
            transforms.RandomResizedCrop(a.size, scale=(0.7, 1.0)),
            transforms.RandomHorizontalFlip(),
        ],
        "imagenet": [transforms.RandomResizedCrop(a.size), transforms.RandomHorizontalFlip()],
        "timm": [
            transforms.RandomResizedCrop(a.size, scale=(0.7, 1.0)),
            transforms.RandomHorizontalFlip(),
            transforms.RandAugment(num_ops=2, magnitude=9),
        ],
    }[a.preset]
    timm = a.preset == "timm"
    after = [transforms.RandomErasing(p=0.25, value=0)] if timm else []
    train_set = torchvision.datasets.ImageFolder(
        f"{a.data}/train", transforms.Compose(train_tf + [transforms.ToTensor(), norm] + after)
    )
    val_set = torchvision.datasets.ImageFolder(
        f"{a.data}/val", transforms.Compose(evaluation + [transforms.ToTensor(), norm])
    )
    train = torch.utils.data.DataLoader(
        train_set, batch_size=a.batch_size, shuffle=True, num_workers=a.workers
    )
    val = torch.utils.data.DataLoader(val_set, batch_size=a.batch_size, num_workers=a.workers)
    classes = len(train_set.classes)
    model = torchvision.models.resnet18(num_classes=classes) if timm else mini_resnet(classes)
    ema = None
    mix = None
    if timm:
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
        from torchvision.transforms import v2

        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.99), use_buffers=True)
        mix = v2.RandomChoice(
            [v2.MixUp(alpha=0.2, num_classes=classes), v2.CutMix(alpha=1.0, num_classes=classes)]
        )
    decay = [q for q in model.parameters() if q.ndim > 1]
    no_decay = [q for q in model.parameters() if q.ndim <= 1]
    opt = torch.optim.SGD(
        [{"params": decay, "weight_decay": 5e-4}, {"params": no_decay, "weight_decay": 0.0}],
        lr=a.lr,
        momentum=0.9,
    )
    steps = len(train)
    warmup, total = steps, steps * a.epochs

    def factor(i):
        if i < warmup:
            return (i + 1) / warmup
        t = (i - warmup) / max(1, total - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1 if timm else 0.0)
    best, best_epoch, train_acc, best_ema = -1.0, 0, 0.0, -1.0
    started = time.perf_counter()
    for epoch in range(1, a.epochs + 1):
        model.train()
        right = seen = 0
        for x, y in train:
            opt.zero_grad()
            target = y
            if mix is not None:
                x, target = mix(x, y)
            out = model(x)
            loss_fn(out, target).backward()
            if timm:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if ema is not None:
                ema.update_parameters(model)
            right += (out.argmax(1) == y).sum().item()
            seen += len(y)
        train_acc = 100.0 * right / seen
        acc = evaluate(model, val)
        if acc > best:
            best, best_epoch = acc, epoch
        if ema is not None:
            best_ema = max(best_ema, evaluate(ema, val))
    seconds = time.perf_counter() - started
    ema_field = f" best_ema_val_acc={best_ema:.2f}" if ema is not None else ""
    print(
        f"peer preset={a.preset} epochs={a.epochs} train_acc={train_acc:.2f} "
        f"best_val_acc={best:.2f} best_epoch={best_epoch} seconds={seconds:.1f}{ema_field}"
    )


def evaluate(model, val):
    model.eval()
    right = seen = 0
    with torch.no_grad():
        for x, y in val:
            right += (model(x).argmax(1) == y).sum().item()
            seen += len(y)
    return 100.0 * right / seen


if __name__ == "__main__":
    main()
