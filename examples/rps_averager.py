"""Your own training loop, averaged by RPS over a lossy network: two lines of shaky.

Run on one machine with two processes (gloo, CPU):

    torchrun --nproc-per-node 2 examples/rps_averager.py --drop-rate 0.1 --steps 300

Each rank trains its own copy of the model below on its own half of
scikit-learn's digits; after every optimizer step, ``averager.step()`` averages
the models block by block, losing 10% of the messages.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import shaky


class Net(torch.nn.Module):  # any model of yours
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drop-rate", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial model on every rank
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x / 16.0, y, test_size=0.2, random_state=0, stratify=y)
    x_mine = torch.tensor(x_train[rank::world], dtype=torch.float32)
    y_mine = torch.tensor(y_train[rank::world])

    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    averager = shaky.RPSAverager(model, network={"drop_rate": args.drop_rate})  # <- shaky, line 1
    generator = torch.Generator().manual_seed(rank)
    for _ in range(args.steps):
        idx = torch.randint(len(y_mine), (32,), generator=generator)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x_mine[idx]), y_mine[idx]).backward()
        optimizer.step()
        averager.step()                                                            # <- shaky, line 2

    with torch.no_grad():
        accuracy = (model(torch.tensor(x_test, dtype=torch.float32)).argmax(1) == torch.tensor(y_test)).float().mean()
    # One write per line: print() writes the text and the newline separately, and two ranks
    # sharing torchrun's stdout can interleave between them.
    sys.stdout.write(f"rank {rank}: test accuracy {accuracy:.4f}, messages dropped {averager.messages_dropped} "
                     f"of {averager.messages_sent}\n")
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
