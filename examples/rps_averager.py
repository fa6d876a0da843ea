"""Your own training loop, averaged by RPS over a lossy network: two lines of shaky.

Run on one machine with two processes (gloo, CPU):

    torchrun --nproc-per-node 2 examples/rps_averager.py --drop-rate 0.1 --steps 300

Each rank trains its own copy of the model below on its own part of
scikit-learn's digits; after every optimizer step, ``averager.step()`` averages
the models block by block, losing 10% of the messages.

Over real UDP datagrams, which are never resent (the losses are the network's),
with ranks that survive the death of another: start them yourself, not under
torchrun, whose agent stops every worker when one fails (README, "Survivors
train on"). Three ranks on this machine, each in a shell of its own (R = 0, 1, 2):

    export SHAKY_KEY=$(openssl rand -hex 32) TORCH_CPP_LOG_LEVEL=ERROR  # the same in every shell
    MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 WORLD_SIZE=3 RANK=R \
        python examples/rps_averager.py --transport udp --steps 2000

Kill any rank part way, rank 0 included (kill -9): the others go on with two
after the heartbeat timeout (3 s) and finish every step (``--log-every 50``
shows the live workers). ``shaky.init_process_group()`` is what makes rank 0
like the others: it joins the gloo group as torch's does, but rank 0 hands the
run's store to a keeper process of its own instead of hosting it itself.
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
    parser.add_argument("--transport", choices=("gloo", "udp"), default="gloo")
    parser.add_argument("--log-every", type=int, default=0, metavar="N", help="print the loss every N steps")
    args = parser.parse_args()

    shaky.init_process_group()  # torch.distributed's gloo group; the store in a keeper, not in rank 0's process
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial model on every rank
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x / 16.0, y, test_size=0.2, random_state=0, stratify=y)
    x_mine = torch.tensor(x_train[rank::world], dtype=torch.float32)
    y_mine = torch.tensor(y_train[rank::world])

    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    network = {} if args.transport == "udp" else {"drop_rate": args.drop_rate}
    averager = shaky.RPSAverager(model, network=network, transport=args.transport)  # <- shaky, line 1
    generator = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        idx = torch.randint(len(y_mine), (32,), generator=generator)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x_mine[idx]), y_mine[idx])
        loss.backward()
        optimizer.step()
        averager.step()                                                            # <- shaky, line 2
        if args.log_every and (step + 1) % args.log_every == 0:
            sys.stdout.write(f"rank {rank}: step {step + 1}, loss {loss.item():.4f}, "
                             f"live workers {averager.live_workers}\n")
            sys.stdout.flush()
    averager.close()   # udp: its threads end before the process does

    with torch.no_grad():
        accuracy = (model(torch.tensor(x_test, dtype=torch.float32)).argmax(1) == torch.tensor(y_test)).float().mean()
    # One write per line: print() writes the text and the newline separately, and two ranks
    # sharing torchrun's stdout can interleave between them.
    sys.stdout.write(f"rank {rank}: test accuracy {accuracy:.4f}, messages dropped {averager.messages_dropped} "
                     f"of {averager.messages_sent}, live workers {averager.live_workers}\n")
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
