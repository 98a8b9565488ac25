#!/usr/bin/env python3
"""Writes python_random_expected.txt: the expectations of the Python-random
compatibility tests (tests/plugins/batching/python_random_test.cpp).

Run with Python 3 (3.2 or later; shuffle and getrandbits are unchanged since):
    python3 gen_python_random.py > python_random_expected.txt

Line formats:
    bits SEED K V1 V2 V3 V4        random.Random(SEED).getrandbits(K), 4 draws
    shuffle SEED N P0 P1 ...       random.Random(SEED).shuffle(list(range(N)))
    shufflesum SEED N S            same, N large: S = sum(i * p[i]) mod 2**61-1
"""
import random

M = 2**61 - 1
for seed in [0, 1, 42, 1234, -7, 2**32 - 1, 2**32 + 5, 2**40 + 3, 2**63 - 1]:
    for k in [1, 7, 31, 32, 33, 63, 64]:
        r = random.Random(seed)
        print("bits", seed, k, *[r.getrandbits(k) for _ in range(4)])
for seed, n in [(0, 10), (1234, 10), (1234, 1), (1234, 2), (42, 33), (-5, 20), (2**40 + 3, 17),
                (721061901, 9)]:
    x = list(range(n))
    random.Random(seed).shuffle(x)
    print("shuffle", seed, n, *x)
for seed, n in [(1234, 100000), (99, 65537)]:
    x = list(range(n))
    random.Random(seed).shuffle(x)
    print("shufflesum", seed, n, sum(i * p for i, p in enumerate(x)) % M)
