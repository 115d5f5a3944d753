"""One step's model inputs as plain integers: what rank 0 of a worker group sends
its peers each step so that every rank runs the same forward on its shard.

It carries only the step (block copies, the tokens to compute with their positions
and KV slots, the block tables of the sequences in the batch, the rows that become
logits), never the scheduler's state. On the wire it is one int64 tensor: no
pickle, so nothing a peer receives can run code."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StepInputs:
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) blocks, before the forward
    token_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # block_id * block_size + offset, per token
    decode_tables: list[list[int]] = field(default_factory=list)  # block ids of each decode row
    decode_lens: list[int] = field(default_factory=list)  # its tokens with KV once this step's is written
    prefills: list[tuple[int, int, int, list[int]]] = field(default_factory=list)  # (row, tokens, context, blocks)
    logit_rows: list[int] = field(default_factory=list)  # rows whose hidden state becomes logits

    def encode(self) -> torch.Tensor:
        out: list[int] = [len(self.block_copies)]
        for src, dst in self.block_copies:
            out += (src, dst)
        out.append(len(self.token_ids))
        out += self.token_ids
        out += self.positions
        out += self.slots
        out.append(len(self.decode_tables))
        for table, length in zip(self.decode_tables, self.decode_lens):
            out += (length, len(table), *table)
        out.append(len(self.prefills))
        for row, num_tokens, context, table in self.prefills:
            out += (row, num_tokens, context, len(table), *table)
        out.append(len(self.logit_rows))
        out += self.logit_rows
        return torch.tensor(out, dtype=torch.int64)

    @classmethod
    def decode(cls, data: torch.Tensor) -> StepInputs:
        values = data.tolist()
        pos = 0

        def take(n: int) -> list[int]:
            nonlocal pos
            if n < 0 or pos + n > len(values):
                raise ValueError(f"step message truncated: wants {n} values at {pos} of {len(values)}")
            pos += n
            return values[pos - n:pos]

        step = cls()
        for _ in range(take(1)[0]):
            src, dst = take(2)
            step.block_copies.append((src, dst))
        n = take(1)[0]
        step.token_ids, step.positions, step.slots = take(n), take(n), take(n)
        for _ in range(take(1)[0]):
            length, width = take(2)
            step.decode_lens.append(length)
            step.decode_tables.append(take(width))
        for _ in range(take(1)[0]):
            row, num_tokens, context, width = take(4)
            step.prefills.append((row, num_tokens, context, take(width)))
        step.logit_rows = take(take(1)[0])
        if pos != len(values):
            raise ValueError(f"step message has {len(values) - pos} values past its end")
        return step


def encode_micro_batches(steps: list[StepInputs]) -> torch.Tensor:
    """Several steps in one message: their count, then each one's length and values."""
    parts = [step.encode() for step in steps]
    head = [len(parts)] + [len(p) for p in parts]
    return torch.cat([torch.tensor(head, dtype=torch.int64), *parts])


def decode_micro_batches(data: torch.Tensor) -> list[StepInputs]:
    count = int(data[0]) if len(data) else -1
    if not 0 < count < len(data):
        raise ValueError(f"micro-batch message names {count} steps in {len(data)} values")
    lengths = data[1:1 + count].tolist()
    if min(lengths) < 0 or 1 + count + sum(lengths) != len(data):
        raise ValueError(f"micro-batch message of {len(data)} values does not hold steps of {lengths} values")
    return [StepInputs.decode(part) for part in data[1 + count:].split(lengths)]
