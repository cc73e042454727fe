"""protocol.profiles: a routing profile's n-gram hashing, combining and wire form."""
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from protocol.profiles import DEFAULT_DIM, ProfileError, combine_profiles, profile_from_json, profile_to_json, text_profile

ROOT = Path(__file__).resolve().parents[2]


def sql_prompts(n: int) -> list[str]:
    return [f"SELECT amount_{i} FROM invoices_{i % 3} WHERE region = 'r{i % 5}' ORDER BY created_at" for i in range(n)]


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
    texts = sql_prompts(10)
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



# ---- wire form -----------------------------------------------------------------------------

def test_profile_round_trips_through_json_exactly():
    vector = text_profile(sql_prompts(30))
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
