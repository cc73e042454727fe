"""Template families over records (lists of dicts), geometry, and word filters."""
from __future__ import annotations

import math
import re

from .pyfunc import PyFunction, fn

PEOPLE = ("people", "list[dict]", 'Records with "name" (str), "age" (int) and "city" (str).')
PEOPLE_CASES = [([{"name": "Ada", "age": 36, "city": "London"}, {"name": "Linus", "age": 17, "city": "Helsinki"},
                  {"name": "Grace", "age": 45, "city": "New York"}, {"name": "Tim", "age": 17, "city": "London"}],),
                ([],)]
CART = ("cart", "list[dict]", 'Line items with "price" (float) and "quantity" (int).')
CART_CASES = [([{"price": 2.5, "quantity": 4}, {"price": 10.0, "quantity": 1}],), ([],)]


def _records() -> list[PyFunction]:
    return [
        fn("records", "adult_names", [PEOPLE], "list[str]", "Return the names of people aged 18 or over, in input order.",
           "The adults' names.", 'return [p["name"] for p in people if p["age"] >= 18]',
           lambda ps: [p["name"] for p in filter(lambda p: not p["age"] < 18, ps)], PEOPLE_CASES),
        fn("records", "oldest_person", [PEOPLE], "str | None", "Return the name of the oldest person (first on ties), or None.",
           "A name or None for an empty list.",
           'if not people:\n    return None\nreturn max(people, key=lambda p: p["age"])["name"]',
           lambda ps: sorted(ps, key=lambda p: -p["age"])[0]["name"] if ps else None, PEOPLE_CASES),
        fn("records", "average_age", [PEOPLE], "float", "Return the mean age, or 0.0 for an empty list.", "The average age.",
           'if not people:\n    return 0.0\nreturn sum(p["age"] for p in people) / len(people)',
           lambda ps: math.fsum(p["age"] for p in ps) / len(ps) if ps else 0.0, PEOPLE_CASES),
        fn("records", "sort_by_age", [PEOPLE], "list[dict]", "Return the records sorted by age, youngest first, then by name.",
           "A new sorted list.", 'return sorted(people, key=lambda p: (p["age"], p["name"]))',
           lambda ps: sorted(sorted(ps, key=lambda p: p["name"]), key=lambda p: p["age"]), PEOPLE_CASES),
        fn("records", "names_by_city", [PEOPLE], "dict[str, list[str]]", "Group people's names by city.",
           "A dict from city to the names living there, in input order.",
           'groups = {}\nfor p in people:\n    groups.setdefault(p["city"], []).append(p["name"])\nreturn groups',
           lambda ps: {c: [p["name"] for p in ps if p["city"] == c] for c in dict.fromkeys(p["city"] for p in ps)},
           PEOPLE_CASES),
        fn("records", "find_by_name", [PEOPLE, ("name", "str", "The name to look for.")], "dict | None",
           "Return the first record with the given name, or None.", "The matching record or None.",
           'for p in people:\n    if p["name"] == name:\n        return p\nreturn None',
           lambda ps, n: next((p for p in ps if p["name"] == n), None), [(PEOPLE_CASES[0][0], "Grace"), ([], "x")]),
        fn("records", "cart_total", [CART], "float", "Return the total price of a shopping cart.",
           "The sum of price * quantity over all items.", 'return sum(item["price"] * item["quantity"] for item in cart)',
           lambda c: math.fsum(i["price"] * i["quantity"] for i in c), CART_CASES),
        fn("records", "apply_discount", [CART, ("percent", "float", "Discount from 0 to 100.")], "list[dict]",
           "Return new line items with every price reduced by percent.", "Copies of the items with discounted prices.",
           'factor = 1 - percent / 100\nreturn [{**item, "price": item["price"] * factor} for item in cart]',
           lambda c, pct: [dict(i, price=i["price"] * (100 - pct) / 100) for i in c], [(CART_CASES[0][0], 20.0)]),
        fn("records", "item_count", [CART], "int", "Return how many units are in the cart in total.",
           "The sum of the quantities.", 'return sum(item["quantity"] for item in cart)',
           lambda c: sum(map(lambda i: i["quantity"], c)), CART_CASES),
    ]


def _geometry() -> list[PyFunction]:
    r = [("radius", "float", "The radius, non-negative.")]
    pts = [("x1", "float", "First point x."), ("y1", "float", "First point y."),
           ("x2", "float", "Second point x."), ("y2", "float", "Second point y.")]
    pt_cases = [(0.0, 0.0, 3.0, 4.0), (1.0, 1.0, 1.0, 1.0), (-2.0, 5.0, 4.0, -3.0)]
    return [
        fn("geometry", "circle_area", r, "float", "Return the area of a circle.", "pi * radius**2.",
           "return math.pi * radius ** 2", lambda x: math.pi * x * x, [(0.0,), (1.0,), (2.5,)], ("import math",)),
        fn("geometry", "circle_circumference", r, "float", "Return the circumference of a circle.", "2 * pi * radius.",
           "return 2 * math.pi * radius", lambda x: math.tau * x, [(0.0,), (1.0,), (2.5,)], ("import math",)),
        fn("geometry", "sphere_volume", r, "float", "Return the volume of a sphere.", "4/3 * pi * radius**3.",
           "return 4 / 3 * math.pi * radius ** 3", lambda x: 4 * math.pi * x ** 3 / 3, [(0.0,), (1.0,), (3.0,)], ("import math",)),
        fn("geometry", "distance", pts, "float", "Return the Euclidean distance between two points.", "The straight-line distance.",
           "return ((x2 - x1) ** 2 + (y2 - y1) ** 2) ** 0.5", lambda a, b, c, d: math.dist((a, b), (c, d)), pt_cases),
        fn("geometry", "manhattan_distance", pts, "float", "Return the Manhattan (taxicab) distance between two points.",
           "|x2 - x1| + |y2 - y1|.", "return abs(x2 - x1) + abs(y2 - y1)",
           lambda a, b, c, d: math.fsum(map(abs, (c - a, d - b))), pt_cases),
        fn("geometry", "midpoint", pts, "tuple[float, float]", "Return the midpoint of the segment between two points.",
           "The (x, y) midpoint.", "return (x1 + x2) / 2, (y1 + y2) / 2",
           lambda a, b, c, d: (math.fsum((a, c)) / 2, math.fsum((b, d)) / 2), pt_cases),
        fn("geometry", "triangle_area", [("a", "float", "Side a."), ("b", "float", "Side b."), ("c", "float", "Side c.")],
           "float", "Return the area of a triangle from its three side lengths (Heron's formula).", "The area.",
           "s = (a + b + c) / 2\nreturn (s * (s - a) * (s - b) * (s - c)) ** 0.5",
           lambda a, b, c: 0.25 * math.sqrt((a + b + c) * (-a + b + c) * (a - b + c) * (a + b - c)),
           [(3.0, 4.0, 5.0), (2.0, 2.0, 2.0)]),
        fn("geometry", "hypotenuse", [("a", "float", "One leg."), ("b", "float", "The other leg.")], "float",
           "Return the hypotenuse of a right triangle.", "sqrt(a**2 + b**2).", "return (a * a + b * b) ** 0.5",
           math.hypot, [(3.0, 4.0), (1.0, 1.0), (0.0, 2.0)]),
        fn("geometry", "polygon_perimeter", [("points", "list[tuple[float, float]]", "Vertices in order.")], "float",
           "Return the perimeter of a closed polygon given its vertices.", "The sum of the edge lengths.",
           "total = 0.0\nfor i, (x, y) in enumerate(points):\n    nx, ny = points[(i + 1) % len(points)]\n"
           "    total += ((nx - x) ** 2 + (ny - y) ** 2) ** 0.5\nreturn total",
           lambda ps: math.fsum(math.dist(ps[i], ps[i - 1]) for i in range(len(ps))),
           [([(0.0, 0.0), (3.0, 0.0), (3.0, 4.0)],), ([],)]),
        fn("geometry", "rectangle_overlap", [("a", "tuple[float, float, float, float]", "(x, y, width, height)."),
                                             ("b", "tuple[float, float, float, float]", "(x, y, width, height).")],
           "float", "Return the area where two axis-aligned rectangles overlap.", "The overlap area, 0.0 if disjoint.",
           "width = min(a[0] + a[2], b[0] + b[2]) - max(a[0], b[0])\nheight = min(a[1] + a[3], b[1] + b[3]) - max(a[1], b[1])\n"
           "return max(width, 0.0) * max(height, 0.0)",
           lambda a, b: max(0.0, min(a[0] + a[2], b[0] + b[2]) - max(a[0], b[0])) * max(0.0, min(a[1] + a[3], b[1] + b[3]) - max(a[1], b[1])),
           [((0.0, 0.0, 2.0, 2.0), (1.0, 1.0, 2.0, 2.0)), ((0.0, 0.0, 1.0, 1.0), (5.0, 5.0, 1.0, 1.0))]),
    ]


# (suffix, phrase, condition on `word`)
WORD_PREDICATES = [
    ("long_words", "longer than five characters", "len(word) > 5"),
    ("capitalized_words", "that start with an upper-case letter", "word[:1].isupper()"),
    ("words_with_digits", "that contain at least one digit", "any(ch.isdigit() for ch in word)"),
    ("vowel_words", "that start with a vowel", 'word[:1].lower() in ("a", "e", "i", "o", "u")'),
    ("palindromic_words", "that read the same backwards (ignoring case)", "word.lower() == word.lower()[::-1]"),
    ("ing_words", "that end in 'ing'", 'word.endswith("ing")'),
    ("short_words", "of at most three characters", "len(word) <= 3"),
    ("upper_words", "written entirely in upper case", "word.isupper()"),
]
WORD_AGGREGATES = [
    ("find", "Return the words of the text {p}, in order.", "list[str]", "The matching words.",
     "return [word for word in text.split() if {c}]", lambda ws: ws),
    ("count", "Count the words of the text {p}.", "int", "How many words match.",
     "return sum(1 for word in text.split() if {c})", len),
    ("first", "Return the first word of the text {p}, or None.", "str | None", "The first matching word or None.",
     "for word in text.split():\n    if {c}:\n        return word\nreturn None", lambda ws: ws[0] if ws else None),
]
WORD_TEXTS = [("Anna saw 3 kayaks at NOON while Running and singing in Oslo 2024",), ("",),
              ("Level up: the ABC of testing is reading code",)]


def _word_filters() -> list[PyFunction]:
    out = []
    for suffix, phrase, cond in WORD_PREDICATES:
        for prefix, summary, ret, ret_doc, body, agg in WORD_AGGREGATES:
            oracle = (lambda c, a: lambda text: a([w for w in re.findall(r"\S+", text) if eval(c, {"word": w})]))(cond, agg)
            name = f"first_{suffix[:-1]}" if prefix == "first" else f"{prefix}_{suffix}"
            out.append(fn("word_filter", name, [("text", "str", "A sentence of space-separated words.")],
                          ret, summary.format(p=phrase), ret_doc, body.format(c=cond), oracle, WORD_TEXTS))
    return out


def record_functions() -> list[PyFunction]:
    return _records() + _geometry() + _word_filters()
