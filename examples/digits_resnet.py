"""Train a small ResNet with batch norm on scikit-learn's handwritten digits, on 1..N devices.

    pip install -e '.[examples]'            # scikit-learn, which ships the digits
    dspark run --nproc 2 examples/digits_resnet.py --out runs/digits
    dspark run --nproc 1 examples/digits_resnet.py --out runs/digits_1

The data is ``sklearn.datasets.load_digits``: 1,797 grey 8x8 images of the digits 0-9 written by 43
people (UCI's optical recognition data set). A fixed fifth of it is the test set; the model never
trains on it. ``dspark.DataLoader`` gives each rank its rows of every global batch, and reshuffles
every epoch by itself.

Batch norm normalises over each rank's own rows (as PyTorch's DDP does without SyncBatchNorm), so
with the global batch fixed, 2 ranks normalise over batches half as large as 1 rank does: the runs
are close, not identical. Weight decay spares biases and batch norm (the engine's ``param_groups=``);
the learning rate decays along a cosine (a ``torch.optim.lr_scheduler.LambdaLR``). After every epoch
``engine.save(..., extra=...)`` writes a checkpoint of the weights, the optimizer, the loader's
position, the scheduler and the curves; run the same command again, at any ``--nproc``, and it
resumes there. The curves go to ``<out>/digits_resnet.png``.
"""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path

import _support as support
import torch
from torch import nn
from torch.utils.data import TensorDataset

import dspark


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/digits"),
                        help="checkpoints and the PNG of the curves")
    parser.add_argument("--epochs", type=int, default=20, help="train until this many epochs")
    parser.add_argument("--max-steps", type=int, default=None,
                        help="stop after this many steps (a short run; the epoch is saved unfinished)")
    parser.add_argument("--global-batch", type=int, default=128, help="images per step, all ranks")
    parser.add_argument("--width", type=int, default=64, help="channels of the first stage")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (cosine decay)")
    parser.add_argument("--weight-decay", type=float, default=0.01,
                        help="AdamW's, on convolutions and the classifier's matrix (not on biases, norms)")
    parser.add_argument("--strategy", default="replicate", choices=["replicate", "zero1", "zero2", "zero3"])
    return parser.parse_args()


def digits() -> tuple[TensorDataset, TensorDataset]:
    """(train, test) sets of ``(image, label)``: images (1, 8, 8) in [0, 1]; a fixed 20% for test."""
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8)
    labels = torch.tensor(data.target, dtype=torch.int64)  # (N,)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(1234))
    test, train = order[: len(order) // 5], order[len(order) // 5:]
    return TensorDataset(images[train], labels[train]), TensorDataset(images[test], labels[test])


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm, added to the input (projected when the shape changes)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class DigitsResNet(nn.Module):
    """Stem, then two stages of two blocks (8x8 at ``width`` channels, 4x4 at twice that), global
    average pooling and a linear classifier."""

    def __init__(self, width: int, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU())
        self.blocks = nn.Sequential(BasicBlock(width, width, 1), BasicBlock(width, width, 1),
                                    BasicBlock(width, 2 * width, 2), BasicBlock(2 * width, 2 * width, 1))
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        features = self.blocks(self.stem(images))  # (B, 2w, 4, 4)
        return self.head(features.mean(dim=(2, 3)))  # (B, 10)


def test_accuracy(engine: dspark.Engine, test_loader: dspark.DataLoader) -> float:
    def measure(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.tensor([float((logits.argmax(dim=1) == labels).sum()), float(len(labels))])

    correct, total = support.evaluate(engine, test_loader, measure)
    return correct / total


def main() -> None:
    args = parse_args()
    world = dspark.init()
    if world.device.type == "cpu":
        torch.set_num_threads(1)  # one worker = one core
    train_set, test_set = digits()
    loader = dspark.DataLoader(train_set, global_batch_size=args.global_batch, shuffle=True, seed=0)
    # every test image counts: the last, partial batch is split over the ranks too
    test_loader = dspark.DataLoader(test_set, global_batch_size=args.global_batch, shuffle=False,
                                    drop_last=False)
    torch.manual_seed(0)
    engine = dspark.Engine(DigitsResNet(args.width), strategy=args.strategy,
                           optimizer=functools.partial(torch.optim.AdamW, lr=args.lr,
                                                       weight_decay=args.weight_decay),
                           param_groups=support.no_decay_for_biases_and_norms)
    scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, functools.partial(
        support.warmup_cosine, warmup_steps=0, total_steps=args.epochs * len(loader)))
    curves = support.Curves()
    state = {"loader": loader, "scheduler": scheduler, "curves": curves}
    latest = support.latest_checkpoint(args.out)
    if latest is not None:
        engine.load(latest, extra=state)
    if world.is_main:
        print(f"digits_resnet: {len(train_set)} training and {len(test_set)} test images; "
              f"{world.world_size} rank(s), {loader.local_batch_size} images each per step, "
              f"{len(loader)} steps per epoch; "
              + (f"resumed from {latest.name} (epoch {loader.epoch})" if latest else "starting at epoch 0"),
              flush=True)

    def stopped() -> bool:
        return args.max_steps is not None and engine.step_count >= args.max_steps

    start = time.perf_counter()
    while loader.epoch < args.epochs and not stopped():
        for images, labels in loader:  # this rank's rows; each epoch reshuffles by itself
            loss = nn.functional.cross_entropy(engine(images), labels)
            engine.backward(loss)
            engine.step()
            scheduler.step()
            curves.add("train loss", engine.step_count, support.global_mean(loss))  # the global batch's
            if stopped():
                break
        curves.add("test accuracy", engine.step_count, test_accuracy(engine, test_loader))
        curves.train_s += time.perf_counter() - start
        start = time.perf_counter()
        if world.is_main:
            print(f"step {engine.step_count}, {loader.epoch} epoch(s) done: train loss "
                  f"{curves.last('train loss'):.4f}, "
                  f"test accuracy {curves.last('test accuracy'):.4f}", flush=True)
        support.save_checkpoint(engine, args.out, state)

    curves.plot(args.out / "digits_resnet.png", f"ResNet on scikit-learn digits, {world.world_size} rank(s)",
                [["train loss"], ["test accuracy"]])
    if world.is_main:
        accuracy = curves.series.get("test accuracy", [(0, float("nan"))])[-1][1]
        print(f"digits_resnet: {world.world_size} rank(s), epoch {loader.epoch}, step "
              f"{engine.step_count}, test accuracy {accuracy:.4f}, training time {curves.train_s:.1f} s, "
              f"curves in {args.out / 'digits_resnet.png'}", flush=True)
    engine.close()
    dspark.shutdown()


if __name__ == "__main__":
    main()
