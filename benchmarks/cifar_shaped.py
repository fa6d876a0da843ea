"""Random data in CIFAR-10's python batch format, for timing runs where the real CIFAR-10 is not at hand.

    .venv/bin/python benchmarks/cifar_shaped.py DIR              # 50,000 train and 10,000 test images
    .venv/bin/python benchmarks/cifar_shaped.py DIR --train 5000 --test 1000
    shaky train --dataset cifar10 --data-path DIR --model resnet110 --device cuda ...

It writes ``data_batch_1`` to ``data_batch_5`` and ``test_batch`` as CIFAR-10's
own pickles (``{b"data": uint8 [n, 3072], b"labels": [n]}``), with uniformly
random pixels and labels drawn from ``--seed``: what ``--data-path`` reads, so a
run's speed and memory are those of CIFAR-10, while its accuracy stays at chance
(there is nothing to learn). Nothing is downloaded; for real training point
``--data-path`` at the real batches.
"""

from __future__ import annotations

import argparse
import pickle
import sys
from pathlib import Path

import numpy as np


def write(out: Path, train: int, test: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True, exist_ok=True)
    per = -(-train // 5)
    names = [(f"data_batch_{i + 1}", min(per, train - i * per)) for i in range(5)] + [("test_batch", test)]
    for name, n in names:
        batch = {b"data": rng.integers(0, 256, (max(n, 0), 3072), dtype=np.uint8),
                 b"labels": rng.integers(0, 10, max(n, 0)).tolist()}
        with open(out / name, "wb") as f:
            pickle.dump(batch, f, protocol=4)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the directory to write (created if missing)")
    parser.add_argument("--train", type=int, default=50_000, help="training images (default 50,000, as CIFAR-10)")
    parser.add_argument("--test", type=int, default=10_000, help="test images (default 10,000, as CIFAR-10)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the pixels and labels (default 0)")
    args = parser.parse_args(argv)
    for flag, value in (("--train", args.train), ("--test", args.test)):
        if value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"{args.out} exists and is not a directory")
    write(args.out, args.train, args.test, args.seed)
    print(f"wrote {args.train} training and {args.test} test images of random CIFAR-10-shaped data to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
