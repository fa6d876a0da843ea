"""Your own transformer loop, averaged over a lossy network: RPS every step, or DiLoCo's outer step every H.

Run on one machine with two processes (gloo, CPU):

    torchrun --nproc-per-node 2 examples/transformer_averager.py --drop-rate 0.1 --steps 200
    torchrun --nproc-per-node 2 examples/transformer_averager.py --diloco 20 --steps 200
    torchrun --nproc-per-node 2 examples/transformer_averager.py --transport udp --steps 200

Each rank trains its own copy of a small causal transformer (torch's own encoder layers under a causal mask)
on its own part of a text, predicting every next byte; the text is ``shaky.data.synthetic_text``, the same on
every machine, no download. ``RPSAverager`` averages the models block by block after every step, losing
``--drop-rate`` of the messages (drawn, on gloo) or whatever the network loses (``--transport udp``, datagrams
never resent); ``--diloco H`` averages every H steps and takes DiLoCo's Nesterov outer step
(``ModelAverager(period=H, outer_optimizer=OuterSGD(...))``), with AdamW inside as in the paper.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import shaky
from shaky.data import synthetic_text

CONTEXT = 32


class ByteTransformer(torch.nn.Module):  # any model of yours
    def __init__(self, width: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.tokens = torch.nn.Embedding(256, width)
        self.positions = torch.nn.Embedding(CONTEXT, width)
        layer = torch.nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True,
                                                 norm_first=True, activation="gelu")
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(width, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        causal = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        h = self.tokens(x) + self.positions(torch.arange(x.shape[1]))
        return self.head(self.blocks(h, mask=causal, is_causal=True))


def windows(text: bytes) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.tensor(list(text), dtype=torch.int64)
    n = (len(data) - 1) // CONTEXT
    return data[:n * CONTEXT].view(n, CONTEXT), data[1:n * CONTEXT + 1].view(n, CONTEXT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--drop-rate", type=float, default=0.1, help="gloo: the drawn loss rate")
    parser.add_argument("--diloco", type=int, default=0, metavar="H", help="DiLoCo: average every H steps")
    parser.add_argument("--transport", choices=("gloo", "udp"), default="gloo")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial model on every rank
    x, y = windows(synthetic_text(60_000).encode())
    cut = len(x) * 9 // 10                       # the text's last tenth is held out
    x_mine, y_mine = x[:cut][rank::world], y[:cut][rank::world]

    model = ByteTransformer()
    network = {} if args.transport == "udp" else {"drop_rate": args.drop_rate}
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if args.diloco:
        averager = shaky.ModelAverager(model, network=network, period=args.diloco, transport=args.transport,
                                       outer_optimizer=shaky.OuterSGD(lr=0.7, momentum=0.9, nesterov=True))
    else:
        averager = shaky.RPSAverager(model, network=network, transport=args.transport)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(args.steps):
        idx = torch.randint(len(y_mine), (16,), generator=generator)
        optimizer.zero_grad()
        F.cross_entropy(model(x_mine[idx]).flatten(0, 1), y_mine[idx].reshape(-1)).backward()
        optimizer.step()
        averager.step()

    with torch.no_grad():
        loss = F.cross_entropy(model(x[cut:]).flatten(0, 1), y[cut:].reshape(-1))
    # One write per line: two ranks share torchrun's stdout.
    sys.stdout.write(f"rank {rank}: test perplexity {math.exp(float(loss)):.3f}, messages dropped "
                     f"{averager.messages_dropped} of {averager.messages_sent}\n")
    sys.stdout.flush()
    averager.close()   # udp: its threads end before the process does (a store call cut off at exit aborts it)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
