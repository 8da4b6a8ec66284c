"""The engine benchmark's workloads, as conversations of token ids (no tokenizer: the engine
takes token-id prompts).

A conversation is a list of user turns; turn k's prompt is every earlier prompt and answer
followed by turn k's tokens, as in vLLM's multi-turn serving benchmark, so a one-turn
conversation is a plain request. The driver keeps `concurrency` requests in flight, at most one
a conversation, and queues a conversation's next turn behind every turn already waiting, so
conversations interleave.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class Conversation:
    name: str
    turns: list[list[int]]
    max_tokens: int
    tags: dict[str, str] = field(default_factory=dict)


@dataclass
class Workload:
    name: str
    conversations: list[Conversation]
    concurrency: int
    description: str

    @property
    def prompt_tokens_first_turns(self) -> int:
        return sum(len(c.turns[0]) for c in self.conversations)


def _tokens(rng: random.Random, count: int, vocab: int) -> list[int]:
    # ids from a range every model's vocabulary holds, past the special tokens' usual places
    return [rng.randrange(1000, vocab - 1000) for _ in range(count)]


def prefix_repetition(
    *,
    prefixes: int,
    prefix_tokens: int,
    requests: int,
    suffix_tokens: int,
    max_tokens: int,
    concurrency: int,
    vocab: int,
    seed: int = 1,
) -> Workload:
    """`requests` requests, round robin over `prefixes` shared prefixes, each with a suffix of
    its own: a prefix comes back after every other prefix was served, so a GPU cache smaller
    than all of them together never keeps one (LRU), and a CPU tier that holds them all does."""
    rng = random.Random(seed)
    shared = [_tokens(rng, prefix_tokens, vocab) for _ in range(prefixes)]
    conversations = [
        Conversation(
            f"p{i:04d}",
            [shared[i % prefixes] + _tokens(rng, suffix_tokens, vocab)],
            max_tokens,
            {"prefix": str(i % prefixes), "round": str(i // prefixes)},
        )
        for i in range(requests)
    ]
    return Workload(
        "prefix_repetition",
        conversations,
        concurrency,
        f"{requests} requests round robin over {prefixes} prefixes of {prefix_tokens} tokens "
        f"(+{suffix_tokens} own, {max_tokens} out), concurrency {concurrency}",
    )


def multi_turn(
    *,
    conversations: int,
    turns: int,
    first_tokens: int,
    turn_tokens: int,
    max_tokens: int,
    concurrency: int,
    vocab: int,
    seed: int = 2,
) -> Workload:
    """vLLM's multi-turn benchmark's shape: a long first prompt, then short user turns, each
    turn's prompt the whole history; `concurrency` conversations interleaved."""
    rng = random.Random(seed)
    made = [
        Conversation(
            f"m{i:04d}",
            [_tokens(rng, first_tokens, vocab)]
            + [_tokens(rng, turn_tokens, vocab) for _ in range(turns - 1)],
            max_tokens,
        )
        for i in range(conversations)
    ]
    return Workload(
        "multi_turn",
        made,
        concurrency,
        f"{conversations} conversations of {turns} turns (first {first_tokens} tokens, then "
        f"{turn_tokens} a turn, {max_tokens} out), concurrency {concurrency}",
    )


def zero_reuse(
    *,
    requests: int,
    prompt_tokens: int,
    max_tokens: int,
    concurrency: int,
    vocab: int,
    seed: int = 3,
) -> Workload:
    """No prompt shares a block with another: what a CPU tier costs when nothing is reused."""
    rng = random.Random(seed)
    made = [
        Conversation(f"z{i:04d}", [_tokens(rng, prompt_tokens, vocab)], max_tokens)
        for i in range(requests)
    ]
    return Workload(
        "zero_reuse",
        made,
        concurrency,
        f"{requests} requests of {prompt_tokens} unshared tokens ({max_tokens} out), "
        f"concurrency {concurrency}",
    )
