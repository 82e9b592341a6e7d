"""The bank of small Python functions the code task asks for, with reference solutions.

Each problem has a reference solution (source text, run on the host only to compute
expected outputs and to build demonstrations) and an argument generator. Test cases are a
pure function of (problem, seed): the same instance has the same hidden tests everywhere.

Invariant: arguments and results are JSON values (ints, strings, bools, lists), so the
verifier compares canonical JSON and a result object with a rigged `__eq__` cannot pass.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Args = list[Any]


@dataclass(frozen=True)
class Problem:
    name: str  # the function's name
    signature: str
    description: str
    solution: str  # reference source defining `name`
    make_args: Callable[[random.Random], Args]
    examples: tuple[tuple[Any, ...], ...]  # visible example arguments

    def reference(self) -> Callable[..., Any]:
        namespace: dict[str, Any] = {}
        exec(self.solution, namespace)  # trusted: our own reference source
        return namespace[self.name]

    def cases(self, seed: int, count: int) -> list[tuple[Args, Any]]:
        """`count` hidden (args, expected) pairs, deterministic in `seed`."""
        rng = random.Random(f"code:{self.name}:{seed}")
        fn = self.reference()
        out = []
        for _ in range(count):
            args = self.make_args(rng)
            out.append((args, fn(*args)))
        return out


def _word(rng: random.Random, alphabet: str = string.ascii_lowercase, n: int = 8) -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, n)))


PROBLEMS: tuple[Problem, ...] = (
    Problem(
        "digit_sum",
        "digit_sum(n: int) -> int",
        "the sum of the decimal digits of n (n >= 0).",
        "def digit_sum(n):\n    return sum(int(d) for d in str(n))\n",
        lambda rng: [rng.randint(0, 10 ** rng.randint(1, 9))],
        ((0,), (123,), (9999,)),
    ),
    Problem(
        "count_vowels",
        "count_vowels(s: str) -> int",
        "how many characters of s are vowels (aeiou, either case).",
        "def count_vowels(s):\n    return sum(1 for c in s.lower() if c in 'aeiou')\n",
        lambda rng: [_word(rng, string.ascii_letters + " ", 16)],
        (("",), ("Hello World",), ("AEIOUxyz",)),
    ),
    Problem(
        "run_length",
        "run_length(s: str) -> str",
        "run-length encode s: each run of a character c of length k becomes c followed "
        "by k, e.g. 'aaab' -> 'a3b1'.",
        "def run_length(s):\n"
        "    out, i = [], 0\n"
        "    while i < len(s):\n"
        "        j = i\n"
        "        while j < len(s) and s[j] == s[i]:\n"
        "            j += 1\n"
        "        out.append(s[i] + str(j - i))\n"
        "        i = j\n"
        "    return ''.join(out)\n",
        lambda rng: [_word(rng, "abc", 12)],
        (("aaab",), ("",), ("abc",)),
    ),
    Problem(
        "second_largest",
        "second_largest(xs: list[int]) -> int",
        "the second largest distinct value in xs (xs has at least two distinct values).",
        "def second_largest(xs):\n    return sorted(set(xs))[-2]\n",
        lambda rng: [rng.sample(range(-50, 50), rng.randint(2, 8)) * rng.randint(1, 2)],
        (([1, 2],), ([5, 5, 3, 9],), ([-1, -7, -3],)),
    ),
    Problem(
        "rotate_left",
        "rotate_left(xs: list[int], k: int) -> list[int]",
        "xs rotated left by k positions (k >= 0, may exceed len(xs); [] stays []).",
        "def rotate_left(xs, k):\n"
        "    if not xs:\n"
        "        return []\n"
        "    k %= len(xs)\n"
        "    return xs[k:] + xs[:k]\n",
        lambda rng: [[rng.randint(0, 9) for _ in range(rng.randint(0, 6))], rng.randint(0, 9)],
        (([1, 2, 3], 1), ([], 3), ([1, 2], 5)),
    ),
    Problem(
        "is_palindrome",
        "is_palindrome(s: str) -> bool",
        "True when s reads the same backwards, ignoring case and non-alphanumerics.",
        "def is_palindrome(s):\n"
        "    t = [c.lower() for c in s if c.isalnum()]\n"
        "    return t == t[::-1]\n",
        lambda rng: [
            (lambda w: w + (w[::-1] if rng.random() < 0.5 else _word(rng, "ab ,")))(
                _word(rng, "abAB ,", 6)
            )
        ],
        (("A man, a plan, a canal: Panama",), ("ab",), ("",)),
    ),
)

PROBLEMS_BY_NAME = {p.name: p for p in PROBLEMS}
