"""The e2e run's prompts: token-id lists of mixed lengths from a fixed seed.

Token ids, not text, so that what the servers see does not depend on the tokenizer's round
trip. The lengths are chosen against the run's KV block size and the prefill's chunk: short
prompts within one block, prompts spanning many blocks, and prompts longer than the chunk
(prefilled in several steps).
"""

from __future__ import annotations

import random

# First ids of the tokenizer are its special tokens (make_model.py): prompts use the rest.
FIRST_ORDINARY_ID = 3


def make_prompts(count: int, vocab: int, block: int, chunk: int, max_len: int,
                 seed: int = 7) -> list[list[int]]:
    if count < 8:
        raise ValueError(f"count={count}: at least 8 prompts (short, multi-block, chunked)")
    if chunk + 16 > max_len:
        raise ValueError(f"chunk={chunk} leaves no room for a longer prompt below {max_len}")
    rng = random.Random(seed)
    lengths = [
        3,  # less than a block
        block - 1,
        block,  # exactly one block
        block + 1,
        chunk + block // 2,  # longer than the prefill's chunk
        max_len - 64,  # the longest the servers take with the run's max_tokens
    ]
    while len(lengths) < count:
        kind = len(lengths) % 3
        if kind == 0:
            lengths.append(rng.randint(4, 2 * block))
        elif kind == 1:
            lengths.append(rng.randint(4 * block, chunk))  # many blocks
        else:
            lengths.append(rng.randint(2 * block, max_len - 64))
    return [[rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(n)] for n in lengths]
