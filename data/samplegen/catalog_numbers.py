"""Template families of small numeric Python functions (lists, number theory, statistics)."""
from __future__ import annotations

import math
import statistics
from fractions import Fraction

from .pyfunc import PyFunction, fn

INTS = [([3, -1, 4, 0, -5, 9, 2, 6, 15, -12, 30],), ([],), ([7, 7, -7, 10, 21, 100],),
        ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],)]
NUMS = "numbers", "list[int]", "The integers to examine."

# (suffix for the name, phrase for the summary, python condition on `n`)
PREDICATES = [
    ("even", "even", "n % 2 == 0"),
    ("odd", "odd", "n % 2 != 0"),
    ("positive", "strictly positive", "n > 0"),
    ("negative", "negative", "n < 0"),
    ("nonzero", "non-zero", "n != 0"),
    ("above_10", "greater than 10", "n > 10"),
    ("below_5", "less than 5", "n < 5"),
    ("divisible_by_3", "divisible by 3", "n % 3 == 0"),
    ("divisible_by_5", "divisible by 5", "n % 5 == 0"),
    ("divisible_by_7", "divisible by 7", "n % 7 == 0"),
    ("divisible_by_4", "divisible by 4", "n % 4 == 0"),
    ("single_digit", "single-digit (between -9 and 9)", "-9 <= n <= 9"),
    ("two_digit", "two-digit (absolute value from 10 to 99)", "10 <= abs(n) <= 99"),
    ("above_100", "greater than 100", "n > 100"),
]

# (name prefix, summary verb phrase, return type, return doc, body template, oracle over the kept list)
AGGREGATES = [
    ("keep", "Return a new list with only the {p} numbers, in their original order.", "list[int]",
     "The {p} numbers from `numbers`.", "return [n for n in numbers if {c}]", lambda kept: kept),
    ("count", "Count how many numbers in the list are {p}.", "int",
     "How many elements are {p}.", "return sum(1 for n in numbers if {c})", len),
    ("sum", "Return the sum of the {p} numbers in the list (0 when there are none).", "int",
     "The sum of the {p} elements.", "return sum(n for n in numbers if {c})", sum),
    ("largest", "Return the largest {p} number in the list, or None when there is none.",
     "int | None", "The maximum {p} element, or None.",
     "return max((n for n in numbers if {c}), default=None)", lambda kept: max(kept, default=None)),
    ("first", "Return the first {p} number in the list, or None when there is none.",
     "int | None", "The first {p} element, or None.",
     "for n in numbers:\n    if {c}:\n        return n\nreturn None",
     lambda kept: kept[0] if kept else None),
    ("smallest", "Return the smallest {p} number in the list, or None when there is none.",
     "int | None", "The minimum {p} element, or None.",
     "return min((n for n in numbers if {c}), default=None)", lambda kept: min(kept, default=None)),
    ("last", "Return the last {p} number in the list, or None when there is none.",
     "int | None", "The last {p} element, or None.",
     "for n in reversed(numbers):\n    if {c}:\n        return n\nreturn None",
     lambda kept: kept[-1] if kept else None),
]


def _filtered_aggregates() -> list[PyFunction]:
    out = []
    for suffix, phrase, cond in PREDICATES:
        for prefix, summary, ret, ret_doc, body, agg in AGGREGATES:
            oracle = (lambda c, a: lambda numbers: a([n for n in numbers if eval(c, {"n": n})]))(cond, agg)
            out.append(fn("filter_aggregate", f"{prefix}_{suffix}", [NUMS], ret,
                          summary.format(p=phrase), ret_doc.format(p=phrase),
                          body.format(c=cond), oracle, INTS))
    return out


def _elementwise() -> list[PyFunction]:
    maps = [("square_all", "its square", "n * n"), ("cube_all", "its cube", "n ** 3"),
            ("double_all", "twice its value", "2 * n"), ("negate_all", "its negation", "-n"),
            ("abs_all", "its absolute value", "abs(n)"), ("increment_all", "the value plus one", "n + 1"),
            ("last_digit_all", "its last decimal digit", "abs(n) % 10")]
    return [fn("elementwise", name, [NUMS], "list[int]",
               f"Return a new list where each number is replaced by {what}.",
               "A list of the same length as `numbers`.", f"return [{expr} for n in numbers]",
               (lambda e: lambda numbers: [eval(e, {"n": n}) for n in numbers])(expr), INTS)
            for name, what, expr in maps]


def _multiples() -> list[PyFunction]:
    out = []
    for k in (2, 3, 4, 5, 6, 7, 9, 11, 13):
        out.append(fn("sum_multiples", f"sum_multiples_of_{k}", [("limit", "int", "Exclusive upper bound.")],
                      "int", f"Return the sum of all positive multiples of {k} below `limit`.",
                      f"The sum of {k}, {2 * k}, {3 * k}, ... while below `limit`.",
                      f"return sum(range({k}, limit, {k}))",
                      (lambda k: lambda limit: sum(i for i in range(1, max(limit, 1)) if i % k == 0))(k),
                      [(0,), (1,), (k,), (k + 1,), (100,), (1000,)]))
    for power, word in ((2, "squares"), (3, "cubes"), (4, "fourth powers")):
        out.append(fn("sum_multiples", f"sum_of_{word.replace(' ', '_')}", [("n", "int", "How many terms.")],
                      "int", f"Return the sum of the {word} of the integers 1 to `n`.",
                      f"1**{power} + 2**{power} + ... + n**{power}; 0 when n < 1.",
                      f"return sum(i ** {power} for i in range(1, n + 1))",
                      (lambda p: lambda n: sum(Fraction(i) ** p for i in range(1, n + 1)).numerator)(power),
                      [(0,), (1,), (5,), (20,)]))
    return out


def _sequences() -> list[PyFunction]:
    n_param = [("n", "int", "Zero-based index of the term.")]
    cases = [(0,), (1,), (2,), (5,), (10,), (20,)]
    rec = [("fibonacci", "Fibonacci", "0, 1", "a, b = 0, 1\nfor _ in range(n):\n    a, b = b, a + b\nreturn a"),
           ("lucas", "Lucas", "2, 1", "a, b = 2, 1\nfor _ in range(n):\n    a, b = b, a + b\nreturn a"),
           ("pell", "Pell", "0, 1", "a, b = 0, 1\nfor _ in range(n):\n    a, b = b, 2 * b + a\nreturn a"),
           ("jacobsthal", "Jacobsthal", "0, 1",
            "a, b = 0, 1\nfor _ in range(n):\n    a, b = b, b + 2 * a\nreturn a")]
    seeds = {"fibonacci": (0, 1, 1, 1), "lucas": (2, 1, 1, 1), "pell": (0, 1, 2, 1), "jacobsthal": (0, 1, 1, 2)}

    def linear(name):
        a0, b0, p, q = seeds[name]

        def oracle(n):
            terms = [a0, b0]
            while len(terms) <= n:
                terms.append(p * terms[-1] + q * terms[-2])
            return terms[n]
        return oracle
    out = [fn("sequence", name, n_param, "int", f"Return the n-th {title} number (the sequence starts {start}).",
              f"The {title} number at index `n`.", body, linear(name), cases)
           for name, title, start, body in rec]
    out += [
        fn("sequence", "tribonacci", n_param, "int",
           "Return the n-th tribonacci number, where the sequence starts 0, 0, 1.",
           "The tribonacci number at index `n`.",
           "a, b, c = 0, 0, 1\nfor _ in range(n):\n    a, b, c = b, c, a + b + c\nreturn a",
           lambda n: [0, 0, 1, 1, 2, 4, 7, 13, 24, 44, 81][n] if n <= 10 else _trib(n), cases),
        fn("sequence", "factorial", [("n", "int", "A non-negative integer.")], "int",
           "Return n! computed with a loop.", "The product 1 * 2 * ... * n (1 for n = 0).",
           "result = 1\nfor i in range(2, n + 1):\n    result *= i\nreturn result", math.factorial, cases),
        fn("sequence", "double_factorial", [("n", "int", "A non-negative integer.")], "int",
           "Return n!!, the product of every other integer from n down to 1 or 2.",
           "n * (n - 2) * (n - 4) * ...; 1 for n <= 0.",
           "result = 1\nwhile n > 1:\n    result *= n\n    n -= 2\nreturn result",
           lambda n: math.prod(range(n, 0, -2)), cases),
        fn("sequence", "triangular_number", [("n", "int", "Which triangular number.")], "int",
           "Return the n-th triangular number.", "1 + 2 + ... + n.", "return n * (n + 1) // 2",
           lambda n: sum(range(n + 1)), cases),
        fn("sequence", "catalan_number", n_param, "int", "Return the n-th Catalan number.",
           "The Catalan number C(n).",
           "value = 1\nfor i in range(n):\n    value = value * 2 * (2 * i + 1) // (i + 2)\nreturn value",
           lambda n: math.comb(2 * n, n) // (n + 1), cases),
    ]
    return out


def _trib(n: int) -> int:
    terms = [0, 0, 1]
    while len(terms) <= n:
        terms.append(sum(terms[-3:]))
    return terms[n]


def _number_theory() -> list[PyFunction]:
    one = [("n", "int", "A positive integer.")]
    two = [("a", "int", "First integer."), ("b", "int", "Second integer.")]
    pairs = [(12, 18), (7, 13), (0, 5), (100, 75), (21, 6)]
    small = [(1,), (2,), (12,), (28,), (97,), (360,), (1001,)]

    def factors(n):
        return [p for p in range(2, n + 1) for _ in range(_multiplicity(n, p)) if _is_prime(p)]
    return [
        fn("number_theory", "gcd", two, "int", "Return the greatest common divisor of a and b using Euclid's algorithm.",
           "The non-negative greatest common divisor.", "while b:\n    a, b = b, a % b\nreturn abs(a)",
           math.gcd, pairs),
        fn("number_theory", "lcm", two, "int", "Return the least common multiple of a and b.",
           "The smallest positive common multiple, or 0 if either is 0.",
           "if a == 0 or b == 0:\n    return 0\nx, y = a, b\nwhile y:\n    x, y = y, x % y\nreturn abs(a * b) // x",
           lambda a, b: abs(a * b) // math.gcd(a, b) if a and b else 0, pairs),
        fn("number_theory", "is_prime", one, "bool", "Return True if n is a prime number.",
           "Whether `n` is prime.",
           "if n < 2:\n    return False\ni = 2\nwhile i * i <= n:\n    if n % i == 0:\n        return False\n    i += 1\nreturn True",
           _is_prime, small + [(0,), (91,)]),
        fn("number_theory", "primes_below", [("limit", "int", "Exclusive upper bound.")], "list[int]",
           "Return all primes below limit using the sieve of Eratosthenes.", "The primes in increasing order.",
           "if limit < 3:\n    return []\nsieve = [True] * limit\nsieve[0] = sieve[1] = False\n"
           "for i in range(2, int(limit ** 0.5) + 1):\n    if sieve[i]:\n"
           "        sieve[i * i::i] = [False] * len(range(i * i, limit, i))\n"
           "return [i for i, is_p in enumerate(sieve) if is_p]",
           lambda limit: [p for p in range(limit) if _is_prime(p)], [(0,), (2,), (3,), (30,), (100,)]),
        fn("number_theory", "prime_factors", one, "list[int]",
           "Return the prime factors of n in increasing order, with repetition.",
           "Primes whose product is `n`.",
           "factors = []\nd = 2\nwhile d * d <= n:\n    while n % d == 0:\n        factors.append(d)\n        n //= d\n"
           "    d += 1\nif n > 1:\n    factors.append(n)\nreturn factors", factors, small),
        fn("number_theory", "count_divisors", one, "int", "Return how many positive divisors n has.",
           "The number of integers d with n % d == 0.", "return sum(1 for d in range(1, n + 1) if n % d == 0)",
           lambda n: len([d for d in range(1, n + 1) if not n % d]), small),
        fn("number_theory", "is_perfect_number", one, "bool",
           "Return True if n equals the sum of its proper divisors.", "Whether `n` is a perfect number.",
           "return n > 1 and sum(d for d in range(1, n) if n % d == 0) == n",
           lambda n: n in (6, 28, 496, 8128), small + [(6,), (496,)]),
        fn("number_theory", "digit_sum", [("n", "int", "An integer; its sign is ignored.")], "int",
           "Return the sum of the decimal digits of n.", "The digit sum.",
           "return sum(int(d) for d in str(abs(n)))", lambda n: sum(map(int, str(abs(n)))),
           [(0,), (7,), (1234,), (-987,), (1001,)]),
        fn("number_theory", "digital_root", [("n", "int", "A non-negative integer.")], "int",
           "Repeatedly sum the digits of n until a single digit remains and return it.", "A value from 0 to 9.",
           "while n >= 10:\n    n = sum(int(d) for d in str(n))\nreturn n",
           lambda n: 0 if n == 0 else 1 + (n - 1) % 9, [(0,), (9,), (38,), (123456,), (999999999,)]),
        fn("number_theory", "reverse_digits", [("n", "int", "An integer.")], "int",
           "Return n with its decimal digits reversed, keeping the sign.", "The reversed number.",
           "sign = -1 if n < 0 else 1\nreturn sign * int(str(abs(n))[::-1])",
           lambda n: int(str(n)[::-1]) if n >= 0 else -int(str(-n)[::-1]), [(0,), (120,), (-345,), (7,)]),
        fn("number_theory", "is_armstrong", one, "bool",
           "Return True if n equals the sum of its digits each raised to the number of digits.",
           "Whether `n` is an Armstrong (narcissistic) number.",
           "digits = str(n)\nreturn n == sum(int(d) ** len(digits) for d in digits)",
           lambda n: n in (1, 2, 3, 4, 5, 6, 7, 8, 9, 153, 370, 371, 407, 1634),
           [(1,), (10,), (153,), (154,), (370,), (1634,)]),
        fn("number_theory", "collatz_steps", one, "int",
           "Return how many Collatz steps it takes for n to reach 1.", "The number of steps (0 for n = 1).",
           "steps = 0\nwhile n != 1:\n    n = n // 2 if n % 2 == 0 else 3 * n + 1\n    steps += 1\nreturn steps",
           lambda n: {1: 0, 2: 1, 6: 8, 7: 16, 27: 111}[n], [(1,), (2,), (6,), (7,), (27,)]),
    ]


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, n))


def _multiplicity(n: int, p: int) -> int:
    count = 0
    while n % p == 0 and n > 0:
        n //= p
        count += 1
    return count


def _bases() -> list[PyFunction]:
    out = []
    for base, word in ((2, "binary"), (3, "ternary"), (5, "base-5"), (8, "octal"), (16, "hexadecimal")):
        out.append(fn("bases", f"to_{word.replace('-', '_')}", [("n", "int", "A non-negative integer.")], "str",
                      f"Return the {word} representation of n as a string of digits, without any prefix.",
                      f"The digits of `n` in base {base} (\"0\" for zero).",
                      f"digits = \"0123456789abcdef\"\nif n == 0:\n    return \"0\"\nout = []\nwhile n:\n"
                      f"    n, r = divmod(n, {base})\n    out.append(digits[r])\nreturn \"\".join(reversed(out))",
                      (lambda b: lambda n: _to_base(n, b))(base), [(0,), (1,), (10,), (255,), (1000,)]))
    out += [
        fn("bases", "from_base", [("digits", "str", "Digits using 0-9 then a-z."), ("base", "int", "Base from 2 to 36.")],
           "int", "Parse a string of digits in the given base without using int(text, base).",
           "The integer value.",
           "value = 0\nfor ch in digits.lower():\n    value = value * base + \"0123456789abcdefghijklmnopqrstuvwxyz\".index(ch)\n"
           "return value", lambda digits, base: int(digits, base), [("101", 2), ("ff", 16), ("777", 8), ("z", 36)]),
        fn("bases", "count_set_bits", [("n", "int", "A non-negative integer.")], "int",
           "Return how many bits are set to 1 in the binary form of n.", "The population count.",
           "count = 0\nwhile n:\n    n &= n - 1\n    count += 1\nreturn count", lambda n: bin(n).count("1"),
           [(0,), (1,), (255,), (1024,), (12345,)]),
        fn("bases", "is_power_of_two", [("n", "int", "An integer.")], "bool",
           "Return True if n is a positive power of two.", "Whether `n` is 1, 2, 4, 8, ...",
           "return n > 0 and n & (n - 1) == 0", lambda n: n in {2 ** i for i in range(40)},
           [(0,), (1,), (6,), (64,), (-8,)]),
        fn("bases", "next_power_of_two", [("n", "int", "A positive integer.")], "int",
           "Return the smallest power of two that is greater than or equal to n.", "A power of two >= `n`.",
           "power = 1\nwhile power < n:\n    power *= 2\nreturn power",
           lambda n: 1 << max(n - 1, 0).bit_length(), [(1,), (2,), (3,), (17,), (1024,)]),
    ]
    return out


def _to_base(n: int, base: int) -> str:
    return "0" if n == 0 else _to_base(n // base, base).lstrip("0") + "0123456789abcdef"[n % base]


def _statistics() -> list[PyFunction]:
    vals = ("values", "list[float]", "A non-empty list of numbers.")
    data = [([2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0],), ([1.5],), ([10.0, -2.0, 3.5, 3.5],)]
    return [
        fn("statistics", "mean", [vals], "float", "Return the arithmetic mean of values.", "The average value.",
           "return sum(values) / len(values)", statistics.fmean, data),
        fn("statistics", "median", [vals], "float", "Return the median of values.",
           "The middle value, or the mean of the two middle values.",
           "ordered = sorted(values)\nmid = len(ordered) // 2\nif len(ordered) % 2:\n    return ordered[mid]\n"
           "return (ordered[mid - 1] + ordered[mid]) / 2", statistics.median, data),
        fn("statistics", "population_variance", [vals], "float", "Return the population variance of values.",
           "The mean squared deviation from the mean.",
           "mu = sum(values) / len(values)\nreturn sum((v - mu) ** 2 for v in values) / len(values)",
           statistics.pvariance, data),
        fn("statistics", "population_stdev", [vals], "float", "Return the population standard deviation of values.",
           "The square root of the population variance.",
           "mu = sum(values) / len(values)\nreturn (sum((v - mu) ** 2 for v in values) / len(values)) ** 0.5",
           statistics.pstdev, data),
        fn("statistics", "value_range", [vals], "float", "Return the difference between the largest and smallest value.",
           "max(values) - min(values).", "return max(values) - min(values)", lambda v: max(v) - min(v), data),
        fn("statistics", "normalize", [vals], "list[float]",
           "Scale values linearly to the range 0 to 1; if all values are equal return a list of zeros.",
           "The rescaled values, in the same order.",
           "low, high = min(values), max(values)\nif high == low:\n    return [0.0 for _ in values]\n"
           "return [(v - low) / (high - low) for v in values]",
           lambda v: [0.0] * len(v) if max(v) == min(v) else [(x - min(v)) / (max(v) - min(v)) for x in v], data),
        fn("statistics", "weighted_mean",
           [vals, ("weights", "list[float]", "Non-negative weights, one per value, not all zero.")], "float",
           "Return the mean of values weighted by weights.", "sum(v * w) / sum(w).",
           "total = sum(v * w for v, w in zip(values, weights))\nreturn total / sum(weights)",
           lambda v, w: statistics.fmean(v, weights=w),
           [([1.0, 2.0, 3.0], [3.0, 1.0, 1.0]), ([5.0], [2.0]), ([2.0, 8.0], [1.0, 1.0])]),
        fn("statistics", "moving_average",
           [vals, ("window", "int", "Number of consecutive values to average, at least 1.")], "list[float]",
           "Return the averages of every run of `window` consecutive values.",
           "len(values) - window + 1 averages (empty if the window is longer than the list).",
           "return [sum(values[i:i + window]) / window for i in range(len(values) - window + 1)]",
           lambda v, w: [statistics.fmean(v[i:i + w]) for i in range(len(v) - w + 1)],
           [([1.0, 2.0, 3.0, 4.0, 5.0], 2), ([1.0, 2.0], 3), ([4.0, 4.0, 10.0], 1)]),
        fn("statistics", "mode", [("values", "list[int]", "A non-empty list of integers.")], "int",
           "Return the most common value; on a tie return the one that appears first.",
           "The most frequent element.",
           "counts = {}\nfor v in values:\n    counts[v] = counts.get(v, 0) + 1\nreturn max(counts, key=counts.get)",
           statistics.mode, [([1, 2, 2, 3, 3],), ([5],), ([4, 1, 4, 1, 1],)]),
    ]


def numeric_functions() -> list[PyFunction]:
    return (_filtered_aggregates() + _elementwise() + _multiples() + _sequences() + _number_theory()
            + _bases() + _statistics())
