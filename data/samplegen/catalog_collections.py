"""Template families of small Python functions over lists, matrices and dictionaries."""
from __future__ import annotations

import bisect
import collections
import heapq
import itertools

from .pyfunc import PyFunction, fn

ITEMS = ("items", "list", "The input list.")
LISTS = [([3, 1, 4, 1, 5, 9, 2, 6, 5, 3],), ([],), ([7],), ([2, 2, 2, 8, -1],)]
MATRIX = ("matrix", "list[list[float]]", "A rectangular matrix given as a list of rows.")
SQUARES = [([[1, 2], [3, 4]],), ([[5]],), ([[1, 0, 2], [0, 3, 0], [2, 0, 9]],)]


def _list_utils() -> list[PyFunction]:
    k_param = ("k", "int", "How many positions to rotate by; may exceed the length.")
    return [
        fn("lists", "dedupe", [ITEMS], "list", "Remove duplicates from a list while keeping the first occurrence order.",
           "The distinct items in order of first appearance.",
           "seen = set()\nresult = []\nfor item in items:\n    if item not in seen:\n        seen.add(item)\n"
           "        result.append(item)\nreturn result", lambda xs: list(dict.fromkeys(xs)), LISTS),
        fn("lists", "chunk", [ITEMS, ("size", "int", "Chunk length, at least 1.")], "list[list]",
           "Split a list into consecutive chunks of the given size; the last chunk may be shorter.",
           "The chunks in order.", "return [items[i:i + size] for i in range(0, len(items), size)]",
           lambda xs, n: [list(c) for c in itertools.batched(xs, n)] if hasattr(itertools, "batched")
           else [xs[i:i + n] for i in range(0, len(xs), n)],
           [([1, 2, 3, 4, 5], 2), ([], 3), ([1, 2, 3], 3)]),
        fn("lists", "flatten", [("nested", "list[list]", "A list of lists.")], "list",
           "Flatten one level of nesting.", "All inner elements in order.",
           "return [item for inner in nested for item in inner]",
           lambda nested: list(itertools.chain.from_iterable(nested)), [([[1, 2], [], [3]],), ([],)]),
        fn("lists", "rotate_left", [ITEMS, k_param], "list", "Rotate a list k positions to the left.",
           "A new rotated list.", "if not items:\n    return []\nk %= len(items)\nreturn items[k:] + items[:k]",
           lambda xs, k: _rot(xs, -k), [([1, 2, 3, 4], 1), ([1, 2, 3], 5), ([], 2)]),
        fn("lists", "rotate_right", [ITEMS, k_param], "list", "Rotate a list k positions to the right.",
           "A new rotated list.", "if not items:\n    return []\nk %= len(items)\nreturn items[-k:] + items[:-k] if k else items[:]",
           lambda xs, k: _rot(xs, k), [([1, 2, 3, 4], 1), ([1, 2, 3], 5), ([], 2), ([1, 2], 2)]),
        fn("lists", "interleave", [("first", "list", "First list."), ("second", "list", "Second list.")], "list",
           "Interleave two lists element by element, appending the rest of the longer one.",
           "first[0], second[0], first[1], second[1], ...",
           "result = []\nfor a, b in zip(first, second):\n    result.extend([a, b])\nshorter = min(len(first), len(second))\n"
           "return result + first[shorter:] + second[shorter:]",
           lambda a, b: [x for pair in itertools.zip_longest(a, b, fillvalue=_GAP) for x in pair if x is not _GAP],
           [([1, 3, 5], [2, 4]), ([], [1]), ([1], [])]),
        fn("lists", "pairwise_differences", [("numbers", "list[int]", "A list of integers.")], "list[int]",
           "Return the differences between each number and the one before it.",
           "numbers[1] - numbers[0], numbers[2] - numbers[1], ...",
           "return [b - a for a, b in zip(numbers, numbers[1:])]",
           lambda xs: [b - a for a, b in itertools.pairwise(xs)], LISTS),
        fn("lists", "running_total", [("numbers", "list[int]", "A list of integers.")], "list[int]",
           "Return the running (cumulative) totals of the numbers.", "The prefix sums.",
           "total = 0\nresult = []\nfor n in numbers:\n    total += n\n    result.append(total)\nreturn result",
           lambda xs: list(itertools.accumulate(xs)), LISTS),
        fn("lists", "running_max", [("numbers", "list[int]", "A list of integers.")], "list[int]",
           "Return, for each position, the largest number seen so far.", "The prefix maxima.",
           "result = []\nfor n in numbers:\n    result.append(n if not result else max(result[-1], n))\nreturn result",
           lambda xs: list(itertools.accumulate(xs, max)), LISTS),
        fn("lists", "running_min", [("numbers", "list[int]", "A list of integers.")], "list[int]",
           "Return, for each position, the smallest number seen so far.", "The prefix minima.",
           "result = []\nfor n in numbers:\n    result.append(n if not result else min(result[-1], n))\nreturn result",
           lambda xs: list(itertools.accumulate(xs, min)), LISTS),
        fn("lists", "index_of_max", [("numbers", "list[int]", "A non-empty list of integers.")], "int",
           "Return the index of the largest number (the first one on ties).", "A valid index into `numbers`.",
           "best = 0\nfor i, n in enumerate(numbers):\n    if n > numbers[best]:\n        best = i\nreturn best",
           lambda xs: xs.index(max(xs)), [x for x in LISTS if x[0]]),
        fn("lists", "second_largest", [("numbers", "list[int]", "A list of integers.")], "int | None",
           "Return the second largest distinct value, or None if there is none.", "The runner-up value or None.",
           "distinct = sorted(set(numbers), reverse=True)\nreturn distinct[1] if len(distinct) > 1 else None",
           lambda xs: (heapq.nlargest(2, set(xs)) + [None, None])[1] if len(set(xs)) > 1 else None, LISTS),
        fn("lists", "is_sorted", [ITEMS], "bool", "Return True if the list is in non-decreasing order.",
           "Whether every element is <= the next.", "return all(a <= b for a, b in zip(items, items[1:]))",
           lambda xs: xs == sorted(xs), LISTS + [([1, 2, 2, 3],)]),
        fn("lists", "count_inversions", [("numbers", "list[int]", "A list of integers.")], "int",
           "Count pairs i < j with numbers[i] > numbers[j].", "The number of inversions.",
           "count = 0\nfor i in range(len(numbers)):\n    for j in range(i + 1, len(numbers)):\n"
           "        if numbers[i] > numbers[j]:\n            count += 1\nreturn count",
           lambda xs: sum(1 for a, b in itertools.combinations(xs, 2) if a > b), LISTS),
        fn("lists", "zip_to_dict", [("keys", "list", "The keys."), ("values", "list", "The values, same length.")], "dict",
           "Build a dictionary from parallel lists of keys and values.", "A dict mapping keys[i] to values[i].",
           "result = {}\nfor key, value in zip(keys, values):\n    result[key] = value\nreturn result",
           lambda k, v: dict(zip(k, v)), [(["a", "b"], [1, 2]), ([], [])]),
    ]


_GAP = object()


def _rot(xs: list, k: int) -> list:
    d = collections.deque(xs)
    d.rotate(k)
    return list(d)


def _search_sort() -> list[PyFunction]:
    nums = ("numbers", "list[int]", "The integers to sort.")
    sorted_cases = [([1, 3, 5, 7, 9, 11], 7), ([1, 3, 5], 4), ([], 1), ([2], 2)]
    return [
        fn("search_sort", "binary_search", [("sorted_items", "list[int]", "A list sorted in increasing order."),
                                            ("target", "int", "The value to look for.")], "int",
           "Return the index of target in a sorted list using binary search, or -1 if it is absent.",
           "An index holding `target`, or -1.",
           "lo, hi = 0, len(sorted_items) - 1\nwhile lo <= hi:\n    mid = (lo + hi) // 2\n"
           "    if sorted_items[mid] == target:\n        return mid\n    if sorted_items[mid] < target:\n"
           "        lo = mid + 1\n    else:\n        hi = mid - 1\nreturn -1",
           lambda xs, t: xs.index(t) if t in xs else -1, sorted_cases),
        fn("search_sort", "insertion_point", [("sorted_items", "list[int]", "A list sorted in increasing order."),
                                              ("target", "int", "The value to place.")], "int",
           "Return the leftmost index where target could be inserted to keep the list sorted.", "An index from 0 to len.",
           "lo, hi = 0, len(sorted_items)\nwhile lo < hi:\n    mid = (lo + hi) // 2\n"
           "    if sorted_items[mid] < target:\n        lo = mid + 1\n    else:\n        hi = mid\nreturn lo",
           bisect.bisect_left, sorted_cases),
        fn("search_sort", "merge_sorted", [("first", "list[int]", "A sorted list."), ("second", "list[int]", "A sorted list.")],
           "list[int]", "Merge two sorted lists into one sorted list in linear time.", "All elements, sorted.",
           "i = j = 0\nmerged = []\nwhile i < len(first) and j < len(second):\n    if first[i] <= second[j]:\n"
           "        merged.append(first[i])\n        i += 1\n    else:\n        merged.append(second[j])\n        j += 1\n"
           "return merged + first[i:] + second[j:]", lambda a, b: list(heapq.merge(a, b)),
           [([1, 4, 9], [2, 3, 10, 11]), ([], [1]), ([5], [])]),
        fn("search_sort", "insertion_sort", [nums], "list[int]", "Return a sorted copy of the list using insertion sort.",
           "A new sorted list.",
           "result = list(numbers)\nfor i in range(1, len(result)):\n    current = result[i]\n    j = i - 1\n"
           "    while j >= 0 and result[j] > current:\n        result[j + 1] = result[j]\n        j -= 1\n"
           "    result[j + 1] = current\nreturn result", sorted, LISTS),
        fn("search_sort", "selection_sort", [nums], "list[int]", "Return a sorted copy of the list using selection sort.",
           "A new sorted list.",
           "result = list(numbers)\nfor i in range(len(result)):\n    smallest = min(range(i, len(result)), key=result.__getitem__)\n"
           "    result[i], result[smallest] = result[smallest], result[i]\nreturn result", sorted, LISTS),
        fn("search_sort", "bubble_sort", [nums], "list[int]", "Return a sorted copy of the list using bubble sort.",
           "A new sorted list.",
           "result = list(numbers)\nfor end in range(len(result) - 1, 0, -1):\n    for i in range(end):\n"
           "        if result[i] > result[i + 1]:\n            result[i], result[i + 1] = result[i + 1], result[i]\n"
           "return result", sorted, LISTS),
        fn("search_sort", "max_subarray_sum", [("numbers", "list[int]", "A non-empty list of integers.")], "int",
           "Return the largest sum of a contiguous, non-empty slice (Kadane's algorithm).", "The maximum slice sum.",
           "best = current = numbers[0]\nfor n in numbers[1:]:\n    current = max(n, current + n)\n    best = max(best, current)\n"
           "return best",
           lambda xs: max(sum(xs[i:j]) for i in range(len(xs)) for j in range(i + 1, len(xs) + 1)),
           [([-2, 1, -3, 4, -1, 2, 1, -5, 4],), ([-3, -1, -2],), ([5],)]),
        fn("search_sort", "two_sum", [("numbers", "list[int]", "A list of integers."), ("target", "int", "The wanted sum.")],
           "tuple[int, int] | None", "Return indices (i, j), i < j, of the first pair found whose values add up to target.",
           "A pair of indices, or None when no pair exists.",
           "seen = {}\nfor j, n in enumerate(numbers):\n    if target - n in seen:\n        return seen[target - n], j\n"
           "    seen.setdefault(n, j)\nreturn None",
           lambda xs, t: next(((i, j) for j in range(len(xs)) for i in range(j) if xs[i] + xs[j] == t), None),
           [([2, 7, 11, 15], 9), ([3, 3], 6), ([1, 2], 7)]),
    ]


def _matrices() -> list[PyFunction]:
    return [
        fn("matrix", "transpose", [MATRIX], "list[list[float]]", "Return the transpose of a matrix.",
           "A matrix whose rows are the columns of `matrix`.", "return [list(column) for column in zip(*matrix)]",
           lambda m: [[m[i][j] for i in range(len(m))] for j in range(len(m[0]))], SQUARES + [([[1, 2, 3]],)]),
        fn("matrix", "matrix_add", [("a", "list[list[float]]", "First matrix."), ("b", "list[list[float]]", "Second matrix, same shape.")],
           "list[list[float]]", "Add two matrices of the same shape element by element.", "The element-wise sum.",
           "return [[x + y for x, y in zip(row_a, row_b)] for row_a, row_b in zip(a, b)]",
           lambda a, b: [[a[i][j] + b[i][j] for j in range(len(a[0]))] for i in range(len(a))],
           [([[1, 2], [3, 4]], [[10, 20], [30, 40]])]),
        fn("matrix", "matrix_multiply", [("a", "list[list[float]]", "Left matrix (n x k)."), ("b", "list[list[float]]", "Right matrix (k x m).")],
           "list[list[float]]", "Multiply two matrices given as lists of rows.", "The n x m product.",
           "columns = list(zip(*b))\nreturn [[sum(x * y for x, y in zip(row, col)) for col in columns] for row in a]",
           lambda a, b: [[sum(a[i][t] * b[t][j] for t in range(len(b))) for j in range(len(b[0]))] for i in range(len(a))],
           [([[1, 2], [3, 4]], [[5, 6], [7, 8]]), ([[1, 2, 3]], [[1], [2], [3]])]),
        fn("matrix", "identity_matrix", [("n", "int", "The size.")], "list[list[int]]", "Return the n x n identity matrix.",
           "Ones on the diagonal, zeros elsewhere.", "return [[1 if i == j else 0 for j in range(n)] for i in range(n)]",
           lambda n: [[int(i == j) for j in range(n)] for i in range(n)], [(0,), (1,), (3,)]),
        fn("matrix", "trace", [MATRIX], "float", "Return the trace of a square matrix.", "The sum of the main diagonal.",
           "return sum(matrix[i][i] for i in range(len(matrix)))", lambda m: sum(r[i] for i, r in enumerate(m)), SQUARES),
        fn("matrix", "row_sums", [MATRIX], "list[float]", "Return the sum of each row of a matrix.", "One sum per row.",
           "return [sum(row) for row in matrix]", lambda m: list(map(sum, m)), SQUARES),
        fn("matrix", "column_sums", [MATRIX], "list[float]", "Return the sum of each column of a matrix.",
           "One sum per column.", "return [sum(column) for column in zip(*matrix)]",
           lambda m: [sum(r[j] for r in m) for j in range(len(m[0]))], SQUARES),
        fn("matrix", "is_symmetric", [MATRIX], "bool", "Return True if a square matrix equals its transpose.",
           "Whether matrix[i][j] == matrix[j][i] for all i, j.",
           "n = len(matrix)\nreturn all(matrix[i][j] == matrix[j][i] for i in range(n) for j in range(i + 1, n))",
           lambda m: m == [list(c) for c in zip(*m)], SQUARES),
        fn("matrix", "scale_matrix", [MATRIX, ("factor", "float", "The multiplier.")], "list[list[float]]",
           "Multiply every element of a matrix by a factor.", "A new scaled matrix.",
           "return [[factor * x for x in row] for row in matrix]",
           lambda m, f: [[x * f for x in r] for r in m], [([[1, 2], [3, 4]], 2), ([[5]], -1)]),
    ]


def _dict_utils() -> list[PyFunction]:
    words = ("words", "list[str]", "The words to group.")
    word_cases = [(["apple", "bob", "avocado", "cat", "banana", "kiwi"],), ([],)]
    counts = ("counts", "dict[str, int]", "A mapping from names to counts.")
    count_cases = [({"a": 3, "b": 7, "c": 7, "d": 1},), ({"x": 0},)]
    return [
        fn("dicts", "invert_dict", [("mapping", "dict", "A dict whose values are hashable and distinct.")], "dict",
           "Swap the keys and values of a dictionary.", "A dict mapping each value back to its key.",
           "return {value: key for key, value in mapping.items()}", lambda d: dict(zip(d.values(), d.keys())),
           [({"a": 1, "b": 2},), ({},)]),
        fn("dicts", "merge_counts", [("first", "dict[str, int]", "First counts."), ("second", "dict[str, int]", "Second counts.")],
           "dict[str, int]", "Merge two count dictionaries, adding the counts of shared keys.", "The combined counts.",
           "merged = dict(first)\nfor key, value in second.items():\n    merged[key] = merged.get(key, 0) + value\nreturn merged",
           lambda a, b: {k: a.get(k, 0) + b.get(k, 0) for k in {**a, **b}},
           [({"a": 1, "b": 2}, {"b": 5, "c": 1}), ({}, {"z": 3})]),
        fn("dicts", "group_by_length", [words], "dict[int, list[str]]", "Group words by their length.",
           "A dict from length to the words of that length, in input order.",
           "groups = {}\nfor word in words:\n    groups.setdefault(len(word), []).append(word)\nreturn groups",
           lambda ws: {n: [w for w in ws if len(w) == n] for n in dict.fromkeys(map(len, ws))}, word_cases),
        fn("dicts", "group_by_first_letter", [words], "dict[str, list[str]]",
           "Group non-empty words by their first letter, lower-cased.",
           "A dict from letter to the words starting with it, in input order.",
           "groups = {}\nfor word in words:\n    if word:\n        groups.setdefault(word[0].lower(), []).append(word)\nreturn groups",
           lambda ws: {c: [w for w in ws if w and w[0].lower() == c] for c in dict.fromkeys(w[0].lower() for w in ws if w)},
           word_cases),
        fn("dicts", "keys_with_max_value", [counts], "list[str]",
           "Return all keys whose value equals the maximum value, sorted.", "The sorted keys with the top value.",
           "if not counts:\n    return []\ntop = max(counts.values())\nreturn sorted(k for k, v in counts.items() if v == top)",
           lambda d: sorted(k for k in d if d[k] == max(d.values())), count_cases + [({},)]),
        fn("dicts", "filter_min_count", [counts, ("minimum", "int", "The smallest count to keep.")], "dict[str, int]",
           "Keep only the entries whose count is at least minimum.", "A new filtered dict.",
           "return {key: value for key, value in counts.items() if value >= minimum}",
           lambda d, m: dict(filter(lambda kv: kv[1] >= m, d.items())), [({"a": 3, "b": 7, "c": 1}, 3)]),
        fn("dicts", "sort_by_count", [counts], "list[tuple[str, int]]",
           "Return the (key, count) pairs sorted by count, highest first, then by key.", "The sorted pairs.",
           "return sorted(counts.items(), key=lambda item: (-item[1], item[0]))",
           lambda d: sorted(sorted(d.items()), key=lambda kv: kv[1], reverse=True), count_cases),
        fn("dicts", "count_items", [ITEMS], "dict", "Count how many times each item occurs in a list.",
           "A dict from item to its number of occurrences, in order of first appearance.",
           "counts = {}\nfor item in items:\n    counts[item] = counts.get(item, 0) + 1\nreturn counts",
           lambda xs: dict(collections.Counter(xs)), LISTS),
    ]


def collection_functions() -> list[PyFunction]:
    return _list_utils() + _search_sort() + _matrices() + _dict_utils()
