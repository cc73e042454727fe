"""Router: n-gram profiles (hashing, combining, wire form) and routing between toy domains."""
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from protocol.profiles import DEFAULT_DIM, ProfileError, combine_profiles, profile_from_json, profile_to_json, text_profile
from gateway.router import DEFAULT_THRESHOLD, RouteResult, route

ROOT = Path(__file__).resolve().parents[2]

# Three domains that share no vocabulary beyond English glue words.
TEMPLATES = {
    "sql": ["SELECT {a}, {b} FROM {t} WHERE {a} > 10 ORDER BY {b} DESC",
            "How do I join {t} with orders on {a} and GROUP BY {b}?",
            "Write a query that counts rows in {t} grouped by {a} HAVING COUNT(*) > 1"],
    "python": ["def {a}_{b}(items):\n    return [x for x in items if x.{a}]",
               "How do I sort a list of dicts by the key '{a}' in Python?",
               "Write a Python function that reads {t}.json and returns a dict of {a} to {b}"],
    "cooking": ["How long should I bake {a} bread with {b} at 200 degrees?",
                "A recipe for {t} soup: simmer the {a} with garlic, onions and {b}",
                "Can I replace butter with {a} oil when making {b} cookies?"],
}
WORDS = {
    "sql": ["customer_id", "created_at", "amount", "region", "status", "invoices", "users"],
    "python": ["name", "value", "score", "filename", "config", "records", "payload"],
    "cooking": ["sourdough", "rye", "olive", "butternut", "pumpkin", "lentil", "cinnamon"],
}


def toy_prompts(domain: str, n: int, seed: int) -> list[str]:
    rng = random.Random(f"{domain}-{seed}")
    words = WORDS[domain]
    return [rng.choice(TEMPLATES[domain]).format(a=rng.choice(words), b=rng.choice(words), t=rng.choice(words))
            for _ in range(n)]


@pytest.fixture(scope="module")
def profiles() -> dict[str, np.ndarray]:
    return {domain: text_profile(toy_prompts(domain, 40, seed=0)) for domain in TEMPLATES}


def reference_buckets(text: str, n: int, dim: int) -> list[int]:
    """The documented hash in plain Python integers: polynomial in the bytes, + n, splitmix64 mix."""
    mask = (1 << 64) - 1
    data = text.lower().encode("utf-8")
    out = []
    for i in range(len(data) - n + 1):
        h = 0
        for byte in data[i:i + n]:
            h = (h * 0x100000001B3 + byte) & mask
        x = (h + n) & mask
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        out.append((x ^ (x >> 31)) % dim)
    return out


# ---- profiles ------------------------------------------------------------------------------

def test_profile_is_the_normalised_count_of_hashed_ngrams():
    text = "Grüße, SELECT * from t; select * FROM t"  # non-ASCII and repeated n-grams
    counts = np.zeros(DEFAULT_DIM)
    for n in (3, 4, 5):
        np.add.at(counts, reference_buckets(text, n, DEFAULT_DIM), 1)
    expected = counts / np.linalg.norm(counts)
    profile = text_profile([text])
    assert profile.dtype == np.float32 and profile.shape == (DEFAULT_DIM,)
    np.testing.assert_allclose(profile, expected, rtol=1e-6, atol=1e-7)


def test_a_single_ngram_and_a_repeated_one():
    [bucket] = reference_buckets("abc", 3, 64)
    expected = np.zeros(64, dtype=np.float32)
    expected[bucket] = 1.0
    np.testing.assert_array_equal(text_profile(["abc"], dim=64, ngrams=(3,)), expected)
    # "aaaa" has two 3-grams, both "aaa": one bucket, normalised to 1
    assert np.count_nonzero(text_profile(["aaaa"], dim=64, ngrams=(3,))) == 1
    # counts add up over texts: "abc" twice and "xyz" once is (2, 1) / sqrt(5)
    mixed = text_profile(["abc", "abc", "xyz"], dim=4096, ngrams=(3,))
    [other] = reference_buckets("xyz", 3, 4096)
    [first] = reference_buckets("abc", 3, 4096)
    assert mixed[first] == pytest.approx(2 / math.sqrt(5)) and mixed[other] == pytest.approx(1 / math.sqrt(5))


def test_profile_ignores_case_and_has_no_ngrams_for_short_text():
    assert np.array_equal(text_profile(["Pandas DataFrame"]), text_profile(["pandas dataframe"]))
    assert not text_profile(["ab", ""]).any()
    assert not text_profile([]).any()


@pytest.mark.slow  # a real process
def test_hash_is_the_same_in_another_process_with_another_hash_seed():
    texts = ["Problem: I have a DataFrame df with columns A and B.", "Ünïcode ✓ and SQL: SELECT 1"]
    script = ("import json, sys; from protocol.profiles import text_profile; "
              "print(json.dumps(text_profile(json.loads(sys.argv[1])).tolist()))")
    here = text_profile(texts)
    for seed in ("1", "12345"):
        result = subprocess.run([sys.executable, "-c", script, json.dumps(texts)], capture_output=True, text=True,
                                check=True, cwd=ROOT, env={"PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)})
        assert np.array_equal(np.array(json.loads(result.stdout), dtype=np.float32), here)


def test_combine_profiles_is_the_example_weighted_mean_renormalised():
    a = np.zeros(64, dtype=np.float32)
    b = np.zeros(64, dtype=np.float32)
    a[0], b[1] = 1.0, 1.0
    combined = combine_profiles([(a, 3), (b, 1)])
    assert combined.dtype == np.float32
    assert combined[0] == pytest.approx(3 / math.sqrt(10)) and combined[1] == pytest.approx(1 / math.sqrt(10))
    assert np.array_equal(combine_profiles([(a, 5), (b, 0)]), a)
    # two workers with the same texts give the same profile as one worker with all of them
    texts = toy_prompts("sql", 10, seed=1)
    halves = combine_profiles([(text_profile(texts[:5]), 5), (text_profile(texts[5:]), 5)])
    assert float(halves @ text_profile(texts)) > 0.99


@pytest.mark.parametrize(("profiles", "message"), [
    ([], "no profiles"),
    ([(np.ones(64) / 8, 1), (np.ones(128) / math.sqrt(128), 1)], r"shape \(128,\), expected \(64,\)"),
    ([(np.ones(64) / 8, -1)], "non-negative integer"),
    ([(np.ones(64) / 8, 1.5)], "non-negative integer"),
    ([(np.ones(64) / 8, 0)], "nothing to combine"),
    ([(np.full(64, np.nan), 1)], "NaN"),
])
def test_combine_profiles_validation(profiles, message):
    with pytest.raises(ProfileError, match=message):
        combine_profiles(profiles)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"dim": 0}, "dim must be an integer"),
    ({"dim": 4096.0}, "dim must be an integer"),
    ({"ngrams": ()}, "ngrams"),
    ({"ngrams": (5, 3)}, "increasing"),
    ({"ngrams": (0, 3)}, "ngrams"),
])
def test_text_profile_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        text_profile(["some text"], **kwargs)


def test_text_profile_wants_an_iterable_of_strings():
    with pytest.raises(ProfileError, match="wrap one prompt"):
        text_profile("a bare string")
    with pytest.raises(ProfileError, match="strings"):
        text_profile([b"bytes"])


# ---- routing -------------------------------------------------------------------------------

def test_routes_unseen_prompts_of_separated_domains_to_their_expert(profiles):
    for domain in TEMPLATES:
        for prompt in toy_prompts(domain, 20, seed=99):
            result = route(prompt, profiles)
            assert result.expert == domain, (prompt, result)
            assert result.confidence >= DEFAULT_THRESHOLD
            assert max(result.scores, key=result.scores.get) == domain
            assert set(result.scores) == set(TEMPLATES)


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def test_scores_and_confidence_are_the_documented_formulas(profiles):
    """Cube-root damped cosines; softmax at temperature 0.03 of the centred cosines."""
    prompt = toy_prompts("sql", 1, seed=5)[0] + " " + toy_prompts("cooking", 1, seed=5)[0]
    rows = unit(np.cbrt(np.stack([profiles[d] for d in TEMPLATES]).astype(np.float64)))
    query = unit(np.cbrt(text_profile([prompt]).astype(np.float64)))
    centre = rows.mean(axis=0)
    centred = unit(rows - centre) @ unit(query - centre)
    softmax = np.exp(centred / 0.03) / np.exp(centred / 0.03).sum()

    result = route(prompt, profiles, threshold=0.0)
    assert list(result.scores.values()) == pytest.approx(list(rows @ query), abs=1e-9)
    assert result.confidence == pytest.approx(softmax.max(), abs=1e-9)
    assert 0.4 < result.confidence < 0.99  # a mixed prompt: the formula is not trivially 1
    assert result.expert == list(TEMPLATES)[int(np.argmax(centred))]
    # the threshold is inclusive
    assert route(prompt, profiles, threshold=result.confidence).expert == result.expert
    assert route(prompt, profiles, threshold=min(1.0, result.confidence + 1e-6)).expert is None


def test_an_unlike_or_ambiguous_prompt_goes_to_the_gateway(profiles):
    ambiguous = toy_prompts("sql", 1, seed=5)[0] + " " + toy_prompts("cooking", 1, seed=5)[0]
    # half SQL, half cooking: confidence ~0.55, under a cautious 0.7 (the calibrated default, 0.46, fitted on
    # DS-1000 where right answers came with confidences down to 0.5, routes it to one of its two domains)
    result = route(ambiguous, profiles, threshold=0.7)
    assert result.expert is None and result.confidence < 0.7 and route(ambiguous, profiles).expert == "sql"
    assert min(result.scores, key=result.scores.get) == "python"
    nothing = route("?!", profiles)  # shorter than any n-gram
    assert nothing == RouteResult(None, {d: 0.0 for d in TEMPLATES}, 0.0)
    # identical profiles cannot be told apart: confidence 1 / n_experts
    twins = route("SELECT 1", {"a": profiles["sql"], "b": profiles["sql"]}, threshold=0.6)
    assert twins.expert is None and twins.confidence == pytest.approx(0.5)


def test_threshold_zero_always_picks_an_expert_and_one_expert_is_always_chosen(profiles):
    ambiguous = "How do I bake a SELECT statement?"
    assert route(ambiguous, profiles, threshold=0.0).expert in TEMPLATES
    only = route("Write a Python function", {"python": profiles["python"]})
    assert only.expert == "python" and only.confidence == 1.0


@pytest.mark.parametrize(("profiles", "kwargs", "message"), [
    ({}, {}, "no expert profiles"),
    ({"a": np.ones(64) / 8, "b": np.ones(128) / math.sqrt(128)}, {}, r"shape \(128,\), expected \(64,\)"),
    ({"a": np.ones((2, 64))}, {}, "one vector"),
    ({"a": np.full(64, np.nan)}, {}, "NaN"),
    ({"a": -np.ones(64) / 8}, {}, "negative"),
    ({"a": np.ones(64)}, {}, "norm 8"),
    ({"a": np.ones(64) / 8}, {"threshold": 1.5}, "threshold"),
    ({"a": np.ones(64) / 8}, {"temperature": 0.0}, "temperature"),
])
def test_route_validation(profiles, kwargs, message):
    with pytest.raises(ValueError, match=message):
        route("SELECT * FROM t", profiles, **kwargs)


# ---- wire form -----------------------------------------------------------------------------

def test_profile_round_trips_through_json_exactly():
    vector = text_profile(toy_prompts("python", 30, seed=2))
    obj = json.loads(json.dumps(profile_to_json(vector, 30, DEFAULT_DIM, (3, 4, 5))))
    assert obj["dim"] == DEFAULT_DIM and obj["ngrams"] == [3, 4, 5] and obj["num_examples"] == 30
    back, count = profile_from_json(obj)
    assert count == 30 and back.dtype == np.float32
    assert np.array_equal(back, vector)  # bit for bit: float32 written at full precision


def good_profile() -> dict:
    return profile_to_json(text_profile(["SELECT a FROM t"]), 1)


@pytest.mark.parametrize(("change", "message"), [
    ({"vector": [0.0] * 10}, r"shape \(10,\)"),
    ({"vector": [float("nan")] + [0.0] * (DEFAULT_DIM - 1)}, "NaN"),
    ({"vector": [-1.0] + [0.0] * (DEFAULT_DIM - 1)}, "negative"),
    ({"vector": [2.0] + [0.0] * (DEFAULT_DIM - 1)}, "norm 2"),
    ({"vector": ["0"] * DEFAULT_DIM}, "list of numbers"),
    ({"vector": "abc"}, "list of numbers"),
    ({"num_examples": -1}, "non-negative integer"),
    ({"num_examples": True}, "non-negative integer"),
    ({"num_examples": 2.0}, "non-negative integer"),
    ({"dim": 2048}, "dim=2048"),
    ({"dim": 4096.0}, "re-profile"),
    ({"ngrams": [3, 4]}, "re-profile"),
    ({"ngrams": [3.0, 4, 5]}, "re-profile"),
    ({"format": "something-else"}, "not a fedmoe-profile"),
    ({"version": 2}, "not a fedmoe-profile"),
])
def test_profile_from_json_is_strict(change, message):
    with pytest.raises(ValueError, match=message):
        profile_from_json({**good_profile(), **change})


def test_profile_from_json_wants_an_object_and_profile_to_json_checks_too():
    with pytest.raises(ProfileError, match="JSON object"):
        profile_from_json([1, 2, 3])
    with pytest.raises(ProfileError, match="shape"):
        profile_to_json(np.zeros(100), 1, DEFAULT_DIM, (3, 4, 5))
    with pytest.raises(ProfileError, match="ngrams"):
        profile_to_json(text_profile(["abc"]), 1, DEFAULT_DIM, (3, 3))
