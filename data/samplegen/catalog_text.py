"""Template families of small Python functions over strings, parsing, units and dates."""
from __future__ import annotations

import calendar
import datetime
import itertools
import re
import string
import textwrap

from .pyfunc import PyFunction, fn

TEXT = ("text", "str", "The text to examine.")
TEXTS = [("Hello, World! 123",), ("",), ("AEIOU xyz\t\nQ",), ("Python 3.11 is FUN; isn't it?",)]

# (what, condition on `ch`, oracle predicate)
CHAR_KINDS = [
    ("vowels", 'ch.lower() in "aeiou"', lambda c: c in "aeiouAEIOU"),
    ("consonants", 'ch.isalpha() and ch.lower() not in "aeiou"', lambda c: c in string.ascii_letters and c not in "aeiouAEIOU"),
    ("digits", "ch.isdigit()", lambda c: c in string.digits),
    ("uppercase_letters", "ch.isupper()", lambda c: c in string.ascii_uppercase),
    ("lowercase_letters", "ch.islower()", lambda c: c in string.ascii_lowercase),
    ("whitespace", "ch.isspace()", lambda c: c in string.whitespace),
    ("punctuation", "ch in string.punctuation", lambda c: c in string.punctuation),
]


def _characters() -> list[PyFunction]:
    out = []
    for kind, cond, pred in CHAR_KINDS:
        words = kind.replace("_", " ")
        imports = ("import string",) if "string." in cond else ()
        out.append(fn("characters", f"count_{kind}", [TEXT], "int", f"Count the {words} in a string.",
                      f"The count of {words} in `text`.", f"return sum(1 for ch in text if {cond})",
                      (lambda p: lambda s: len([c for c in s if p(c)]))(pred), TEXTS, imports))
        out.append(fn("characters", f"remove_{kind}", [TEXT], "str", f"Return the text with all {words} removed.",
                      f"`text` without its {words}.", f'return "".join(ch for ch in text if not ({cond}))',
                      (lambda p: lambda s: "".join(itertools.filterfalse(p, s)))(pred), TEXTS, imports))
    return out


def _case_styles() -> list[PyFunction]:
    name = ("name", "str", "An identifier.")
    return [
        fn("case_style", "snake_to_camel", [name], "str", "Convert a snake_case name to camelCase.", "The camelCase name.",
           'head, *rest = name.split("_")\nreturn head + "".join(part.capitalize() for part in rest)',
           lambda s: re.sub(r"_([a-z0-9]?)", lambda m: m.group(1).upper(), s),
           [("snake_case_name",), ("single",), ("http_status_code",)]),
        fn("case_style", "snake_to_pascal", [name], "str", "Convert a snake_case name to PascalCase.", "The PascalCase name.",
           'return "".join(part.capitalize() for part in name.split("_"))',
           lambda s: "".join(map(str.capitalize, s.split("_"))), [("snake_case_name",), ("x",), ("user_id",)]),
        fn("case_style", "camel_to_snake", [name], "str", "Convert a camelCase or PascalCase name to snake_case.",
           "The snake_case name.",
           'chars = []\nfor ch in name:\n    if ch.isupper() and chars:\n        chars.append("_")\n'
           '    chars.append(ch.lower())\nreturn "".join(chars)',
           lambda s: re.sub(r"(?<!^)(?=[A-Z])", "_", s).lower(), [("camelCase",), ("ParseHTTPRequest",), ("x",)]),
        fn("case_style", "snake_to_kebab", [name], "str", "Convert a snake_case name to kebab-case.", "The kebab-case name.",
           'return name.replace("_", "-")', lambda s: "-".join(s.split("_")), [("max_line_length",), ("x",)]),
        fn("case_style", "title_case", [TEXT], "str", "Capitalize the first letter of every word and lower-case the rest.",
           "The words joined by single spaces.", 'return " ".join(word.capitalize() for word in text.split())',
           lambda s: string.capwords(s), TEXTS),
        fn("case_style", "slugify", [("title", "str", "A human-readable title.")], "str",
           "Turn a title into a URL slug: lower-case words made of letters and digits, joined by hyphens.",
           "The slug.", 'words = re.findall(r"[a-z0-9]+", title.lower())\nreturn "-".join(words)',
           lambda s: re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-"),
           [("Hello, World!",), ("  FedMoE: 3 experts & 1 gateway  ",), ("",)], ("import re",)),
    ]


def _words() -> list[PyFunction]:
    sentences = [("the quick brown fox jumps over the lazy dog",), ("",), ("  Hello   big world ",)]
    return [
        fn("words", "reverse_words", [TEXT], "str", "Reverse the order of the words in a sentence.",
           "The words in reverse order, separated by single spaces.", 'return " ".join(reversed(text.split()))',
           lambda s: " ".join(s.split()[::-1]), sentences),
        fn("words", "count_words", [TEXT], "int", "Count the whitespace-separated words in a string.",
           "The number of words.", "return len(text.split())", lambda s: len(re.findall(r"\S+", s)), sentences),
        fn("words", "longest_word", [TEXT], "str", "Return the longest word; the first one wins ties; '' for no words.",
           "The longest word.",
           'best = ""\nfor word in text.split():\n    if len(word) > len(best):\n        best = word\nreturn best',
           lambda s: max(s.split(), key=len, default=""), sentences),
        fn("words", "acronym", [("phrase", "str", "Words separated by spaces or hyphens.")], "str",
           "Build an upper-case acronym from the first letter of each word.", "The acronym.",
           'words = phrase.replace("-", " ").split()\nreturn "".join(word[0].upper() for word in words)',
           lambda s: "".join(w[0] for w in re.split(r"[\s-]+", s) if w).upper(),
           [("portable network graphics",), ("Read-only memory",), ("",)]),
        fn("words", "average_word_length", [TEXT], "float", "Return the mean length of the words, or 0.0 if there are none.",
           "The average number of characters per word.",
           "words = text.split()\nif not words:\n    return 0.0\nreturn sum(len(w) for w in words) / len(words)",
           lambda s: sum(map(len, s.split())) / len(s.split()) if s.split() else 0.0, sentences),
        fn("words", "word_frequencies", [TEXT], "dict[str, int]", "Count each lower-cased word in the text.",
           "A dict from word to count, in order of first appearance.",
           "counts = {}\nfor word in text.lower().split():\n    counts[word] = counts.get(word, 0) + 1\nreturn counts",
           lambda s: {w: s.lower().split().count(w) for w in dict.fromkeys(s.lower().split())}, sentences),
        fn("words", "wrap_text", [TEXT, ("width", "int", "Maximum line length; no word is longer.")], "list[str]",
           "Greedily wrap words into lines no longer than width.", "The wrapped lines.",
           'lines, current = [], ""\nfor word in text.split():\n    candidate = f"{current} {word}" if current else word\n'
           "    if len(candidate) <= width:\n        current = candidate\n    else:\n        lines.append(current)\n"
           "        current = word\nif current:\n    lines.append(current)\nreturn lines",
           lambda s, w: textwrap.wrap(s, w), [("the quick brown fox jumps over the lazy dog", 10), ("", 5)]),
    ]


def _string_algorithms() -> list[PyFunction]:
    return [
        fn("strings", "is_palindrome", [TEXT], "bool",
           "Return True if the text reads the same backwards, ignoring case and anything that is not a letter or digit.",
           "Whether `text` is a palindrome.", "cleaned = [ch.lower() for ch in text if ch.isalnum()]\nreturn cleaned == cleaned[::-1]",
           lambda s: (lambda t: t == t[::-1])(re.sub(r"[^a-z0-9]", "", s.lower())),
           [("A man, a plan, a canal: Panama",), ("hello",), ("",)]),
        fn("strings", "is_anagram", [("first", "str", "First word."), ("second", "str", "Second word.")], "bool",
           "Return True if the two strings are anagrams, ignoring spaces and case.", "Whether they use the same letters.",
           'def letters(s):\n    return sorted(s.replace(" ", "").lower())\nreturn letters(first) == letters(second)',
           lambda a, b: sorted(a.lower().replace(" ", "")) == sorted(b.lower().replace(" ", "")),
           [("Listen", "Silent"), ("dormitory", "dirty room"), ("abc", "abd")]),
        fn("strings", "run_length_encode", [TEXT], "str", "Run-length encode a string as character-count pairs, e.g. 'aaab' -> 'a3b1'.",
           "The encoded string.",
           'if not text:\n    return ""\nparts = []\ncurrent, count = text[0], 1\nfor ch in text[1:]:\n'
           '    if ch == current:\n        count += 1\n    else:\n        parts.append(f"{current}{count}")\n'
           '        current, count = ch, 1\nparts.append(f"{current}{count}")\nreturn "".join(parts)',
           lambda s: "".join(f"{k}{len(list(g))}" for k, g in itertools.groupby(s)), [("aaabccdddd",), ("",), ("x",)]),
        fn("strings", "run_length_decode", [("encoded", "str", "Pairs of a non-digit character and a count.")], "str",
           "Decode a string produced by run-length encoding such as 'a3b1'.", "The original text.",
           'return "".join(ch * int(count) for ch, count in re.findall(r"(\\D)(\\d+)", encoded))',
           lambda s: "".join(c * int(n) for c, n in re.findall(r"(\D)(\d+)", s)), [("a3b1c2",), ("",), ("x12",)], ("import re",)),
        fn("strings", "longest_common_prefix", [("words", "list[str]", "The strings to compare.")], "str",
           "Return the longest prefix shared by all strings ('' for an empty list).", "The common prefix.",
           'if not words:\n    return ""\nprefix = words[0]\nfor word in words[1:]:\n    while not word.startswith(prefix):\n'
           "        prefix = prefix[:-1]\nreturn prefix",
           lambda ws: __import__("os").path.commonprefix(ws), [(["flower", "flow", "flight"],), (["dog", "car"],), ([],)]),
        fn("strings", "balanced_brackets", [TEXT], "bool", "Return True if (), [] and {} in the text are balanced and properly nested.",
           "Whether every bracket is closed in the right order.",
           'pairs = {")": "(", "]": "[", "}": "{"}\nstack = []\nfor ch in text:\n    if ch in "([{":\n        stack.append(ch)\n'
           "    elif ch in pairs:\n        if not stack or stack.pop() != pairs[ch]:\n            return False\nreturn not stack",
           _balanced, [("f(a[1], {b: 2})",), ("(]",), ("((",), ("",)]),
        fn("strings", "levenshtein", [("a", "str", "First string."), ("b", "str", "Second string.")], "int",
           "Return the edit distance between two strings (insertions, deletions, substitutions).",
           "The minimum number of single-character edits.",
           "previous = list(range(len(b) + 1))\nfor i, ca in enumerate(a, 1):\n    current = [i]\n    for j, cb in enumerate(b, 1):\n"
           "        current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))\n"
           "    previous = current\nreturn previous[-1]", _edit_distance, [("kitten", "sitting"), ("", "abc"), ("same", "same")]),
        fn("strings", "count_overlapping", [TEXT, ("pattern", "str", "A non-empty substring.")], "int",
           "Count occurrences of pattern in text, overlapping ones included.", "The number of start positions that match.",
           "return sum(1 for i in range(len(text) - len(pattern) + 1) if text.startswith(pattern, i))",
           lambda s, p: len(re.findall(f"(?={re.escape(p)})", s)), [("aaaa", "aa"), ("abcabc", "abc"), ("", "a")]),
        fn("strings", "truncate", [TEXT, ("width", "int", "Maximum length of the result, at least 3.")], "str",
           "Shorten text to at most width characters, ending with '...' when it was cut.", "The possibly shortened text.",
           'if len(text) <= width:\n    return text\nreturn text[:width - 3] + "..."',
           lambda s, w: textwrap.shorten(s, 10 ** 6) and (s if len(s) <= w else f"{s[:w - 3]}..."),
           [("hello world", 8), ("short", 10), ("abcdef", 6)]),
        fn("strings", "mask_card_number", [("number", "str", "A card number made of digits.")], "str",
           "Replace every digit except the last four with '*'.", "The masked number.",
           'return "*" * max(len(number) - 4, 0) + number[-4:]',
           lambda s: re.sub(r"\d(?=\d{4})", "*", s), [("4111111111111111",), ("123",), ("12345",)]),
    ]


def _balanced(text: str) -> bool:
    text = "".join(c for c in text if c in "()[]{}")
    while any(p in text for p in ("()", "[]", "{}")):
        for p in ("()", "[]", "{}"):
            text = text.replace(p, "")
    return not any(c in "()[]{}" for c in text)


def _edit_distance(a: str, b: str) -> int:
    if not a or not b:
        return len(a) + len(b)
    return min(_edit_distance(a[1:], b) + 1, _edit_distance(a, b[1:]) + 1, _edit_distance(a[1:], b[1:]) + (a[0] != b[0]))


def _ciphers() -> list[PyFunction]:
    out = []
    for shift in (1, 3, 5, 13):
        out.append(fn("cipher", f"caesar_shift_{shift}", [TEXT], "str",
                      f"Shift every ASCII letter {shift} places forward in the alphabet, wrapping around and keeping case.",
                      "The enciphered text; other characters are unchanged.",
                      f"result = []\nfor ch in text:\n    if ch.isascii() and ch.isalpha():\n"
                      f"        base = ord(\"a\") if ch.islower() else ord(\"A\")\n"
                      f"        result.append(chr((ord(ch) - base + {shift}) % 26 + base))\n    else:\n"
                      f"        result.append(ch)\nreturn \"\".join(result)",
                      (lambda k: lambda s: s.translate(_shift_table(k)))(shift), TEXTS + [("xyz XYZ",)]))
    out.append(fn("cipher", "rot13_codecs", [TEXT], "str", "Apply ROT13 to the text using the standard library codecs module.",
                  "The ROT13 form of `text`.", 'return codecs.encode(text, "rot_13")',
                  lambda s: s.translate(_shift_table(13)), TEXTS, ("import codecs",)))
    return out


def _shift_table(k: int) -> dict:
    lo, up = string.ascii_lowercase, string.ascii_uppercase
    return str.maketrans(lo + up, lo[k:] + lo[:k] + up[k:] + up[:k])


def _parsing() -> list[PyFunction]:
    return [
        fn("parsing", "parse_key_values", [TEXT], "dict[str, str]",
           "Parse 'key=value' pairs separated by semicolons into a dict, trimming spaces and skipping empty parts.",
           "The parsed pairs.",
           'result = {}\nfor part in text.split(";"):\n    if part.strip():\n        key, _, value = part.partition("=")\n'
           "        result[key.strip()] = value.strip()\nreturn result",
           lambda s: dict((k.strip(), v.strip()) for k, _, v in (p.partition("=") for p in s.split(";") if p.strip())),
           [("host = example.org; port=8080;",), ("",), ("a=1;a=2",)]),
        fn("parsing", "parse_int_list", [TEXT], "list[int]", "Parse a comma-separated list of integers such as '1, 2, -3'.",
           "The integers; an empty or blank string gives [].",
           'return [int(part) for part in text.split(",") if part.strip()]',
           lambda s: list(map(int, re.findall(r"-?\d+", s))), [("1, 2, -3",), ("",), ("42",)]),
        fn("parsing", "parse_query_string", [("query", "str", "A URL query such as 'a=1&b=two'.")], "dict[str, str]",
           "Parse a URL query string into a dict (no percent-decoding; later keys win).", "The parameters.",
           'params = {}\nfor pair in query.split("&"):\n    if pair:\n        key, _, value = pair.partition("=")\n'
           "        params[key] = value\nreturn params",
           lambda q: {k: v for k, _, v in (p.partition("=") for p in q.split("&") if p)}, [("a=1&b=two&flag",), ("",)]),
        fn("parsing", "file_extension", [("path", "str", "A file path.")], "str",
           "Return the lower-case extension of a file name without the dot, or '' if it has none.", "The extension.",
           'name = path.replace("\\\\", "/").rsplit("/", 1)[-1]\nif "." not in name.lstrip("."):\n    return ""\n'
           'return name.rsplit(".", 1)[1].lower()',
           lambda p: __import__("posixpath").splitext(p.replace("\\", "/"))[1][1:].lower(),
           [("report.PDF",), ("archive.tar.gz",), ("Makefile",), ("dir/.bashrc",), ("C:\\data\\x.csv",)]),
        fn("parsing", "parse_version", [("version", "str", "A dotted version such as '1.10.2'.")], "tuple[int, ...]",
           "Turn a dotted version string into a tuple of integers.", "The numeric parts.",
           'return tuple(int(part) for part in version.split("."))', lambda v: tuple(map(int, v.split("."))),
           [("1.10.2",), ("3",)]),
        fn("parsing", "compare_versions", [("a", "str", "First dotted version."), ("b", "str", "Second dotted version.")], "int",
           "Compare two dotted versions numerically; missing parts count as zero.", "-1, 0 or 1.",
           'x = [int(p) for p in a.split(".")]\ny = [int(p) for p in b.split(".")]\nwidth = max(len(x), len(y))\n'
           "x += [0] * (width - len(x))\ny += [0] * (width - len(y))\nreturn (x > y) - (x < y)",
           _cmp_versions, [("1.2", "1.10"), ("2.0", "2"), ("3.1.4", "3.1")]),
        fn("parsing", "strip_line_comments", [("lines", "list[str]", "Source lines."), ("marker", "str", "The comment marker, e.g. '#'.")],
           "list[str]", "Remove comments that start with marker and drop lines that become blank.",
           "The remaining code lines, right-stripped.",
           "kept = []\nfor line in lines:\n    code = line.split(marker, 1)[0].rstrip()\n    if code:\n        kept.append(code)\nreturn kept",
           lambda ls, m: [c for c in (re.sub(re.escape(m) + ".*", "", line).rstrip() for line in ls) if c],
           [(["x = 1  # one", "# only", "", "y = 2"], "#"), (["SELECT 1; -- q", "-- c"], "--")]),
    ]


def _cmp_versions(a: str, b: str) -> int:
    x, y = [int(p) for p in a.split(".")], [int(p) for p in b.split(".")]
    for i in range(max(len(x), len(y))):
        p, q = (x[i] if i < len(x) else 0), (y[i] if i < len(y) else 0)
        if p != q:
            return 1 if p > q else -1
    return 0


# (name, from, to, factor or formula, python expression of `value`)
CONVERSIONS = [
    ("celsius_to_fahrenheit", "degrees Celsius", "degrees Fahrenheit", "value * 9 / 5 + 32"),
    ("fahrenheit_to_celsius", "degrees Fahrenheit", "degrees Celsius", "(value - 32) * 5 / 9"),
    ("celsius_to_kelvin", "degrees Celsius", "kelvin", "value + 273.15"),
    ("km_to_miles", "kilometres", "miles", "value / 1.609344"),
    ("miles_to_km", "miles", "kilometres", "value * 1.609344"),
    ("kg_to_pounds", "kilograms", "pounds", "value / 0.45359237"),
    ("pounds_to_kg", "pounds", "kilograms", "value * 0.45359237"),
    ("inches_to_cm", "inches", "centimetres", "value * 2.54"),
    ("cm_to_inches", "centimetres", "inches", "value / 2.54"),
    ("litres_to_us_gallons", "litres", "US gallons", "value / 3.785411784"),
    ("hours_to_seconds", "hours", "seconds", "value * 3600"),
    ("kib_to_bytes", "kibibytes", "bytes", "value * 1024"),
    ("metres_to_feet", "metres", "feet", "value / 0.3048"),
    ("feet_to_metres", "feet", "metres", "value * 0.3048"),
    ("kmh_to_mph", "kilometres per hour", "miles per hour", "value / 1.609344"),
    ("mph_to_kmh", "miles per hour", "kilometres per hour", "value * 1.609344"),
    ("hectares_to_acres", "hectares", "acres", "value * 10000 / 4046.8564224"),
    ("days_to_hours", "days", "hours", "value * 24"),
]


def _conversions() -> list[PyFunction]:
    return [fn("units", name, [("value", "float", f"An amount in {src}.")], "float",
               f"Convert a value from {src} to {dst}.", f"The same quantity in {dst}.", f"return {expr}",
               (lambda e: lambda value: eval(e, {"value": value}))(expr), [(0.0,), (1.0,), (-40.0,), (100.0,)])
            for name, src, dst, expr in CONVERSIONS]


def _dates() -> list[PyFunction]:
    year = ("year", "int", "A year of the Gregorian calendar.")
    return [
        fn("dates", "is_leap_year", [year], "bool", "Return True if year is a leap year in the Gregorian calendar.",
           "Whether February has 29 days.", "return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)",
           calendar.isleap, [(1900,), (2000,), (2023,), (2024,)]),
        fn("dates", "days_in_month", [year, ("month", "int", "Month number from 1 to 12.")], "int",
           "Return the number of days in the given month.", "28 to 31.",
           "if month == 2:\n    return 29 if year % 4 == 0 and (year % 100 != 0 or year % 400 == 0) else 28\n"
           "return 30 if month in (4, 6, 9, 11) else 31",
           lambda y, m: calendar.monthrange(y, m)[1], [(2024, 2), (2023, 2), (2023, 4), (1900, 2), (2023, 12)]),
        fn("dates", "day_of_year", [year, ("month", "int", "Month 1-12."), ("day", "int", "Day of the month.")], "int",
           "Return the ordinal day of the year for a date (1 for January 1st).", "A number from 1 to 366.",
           "days = [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]\n"
           "if year % 4 == 0 and (year % 100 != 0 or year % 400 == 0):\n    days[1] = 29\nreturn sum(days[:month - 1]) + day",
           lambda y, m, d: datetime.date(y, m, d).timetuple().tm_yday, [(2024, 3, 1), (2023, 3, 1), (2023, 1, 1), (2000, 12, 31)]),
        fn("dates", "seconds_to_hms", [("seconds", "int", "A non-negative number of seconds.")], "str",
           "Format a number of seconds as H:MM:SS.", "The formatted duration.",
           'hours, rest = divmod(seconds, 3600)\nminutes, secs = divmod(rest, 60)\nreturn f"{hours}:{minutes:02d}:{secs:02d}"',
           lambda s: str(datetime.timedelta(seconds=s)), [(0,), (59,), (3661,), (86399,)]),
        fn("dates", "hms_to_seconds", [("duration", "str", "A duration written as H:MM:SS.")], "int",
           "Parse an H:MM:SS duration into a number of seconds.", "The total seconds.",
           'hours, minutes, seconds = (int(part) for part in duration.split(":"))\nreturn hours * 3600 + minutes * 60 + seconds',
           lambda d: sum(int(p) * 60 ** i for i, p in enumerate(reversed(d.split(":")))), [("0:00:00",), ("1:01:01",), ("25:30:00",)]),
        fn("dates", "int_to_roman", [("number", "int", "An integer from 1 to 3999.")], "str",
           "Convert an integer to Roman numerals.", "The Roman numeral.",
           'symbols = [(1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"),\n'
           '           (50, "L"), (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I")]\nresult = []\n'
           "for value, symbol in symbols:\n    count, number = divmod(number, value)\n    result.append(symbol * count)\n"
           'return "".join(result)', lambda n: _ROMAN[n], [(1,), (4,), (9,), (14,), (1994,), (3999,)]),
        fn("dates", "roman_to_int", [("numeral", "str", "A valid Roman numeral.")], "int",
           "Convert a Roman numeral to an integer.", "Its value.",
           'values = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100, "D": 500, "M": 1000}\ntotal = 0\n'
           "for ch, nxt in zip(numeral, numeral[1:] + \" \"):\n    value = values[ch]\n"
           "    total += -value if nxt != \" \" and values[nxt] > value else value\nreturn total",
           lambda s: {v: k for k, v in _ROMAN.items()}[s], [("III",), ("IV",), ("MCMXCIV",), ("MMMCMXCIX",)]),
    ]


_ROMAN = {1: "I", 4: "IV", 9: "IX", 14: "XIV", 1994: "MCMXCIV", 3999: "MMMCMXCIX", 3: "III"}


def text_functions() -> list[PyFunction]:
    return (_characters() + _case_styles() + _words() + _string_algorithms() + _ciphers() + _parsing()
            + _conversions() + _dates())
