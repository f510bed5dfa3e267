"""Generate the small bundled data sets under jaxrlhf/data/bundled/ (deterministic).

Run `python scripts/make_bundled_data.py` after changing a generator here, then
bump the VERSION of the matching builder in jaxrlhf/data/tasks.py so prepared
copies are rebuilt. Tests check that the committed files equal this output.

Tasks are chosen so a tiny byte-level model learns them on a CPU in minutes:
- arithmetic: "a+b=" -> str(a + b), operands 0..29 (verifiable by exact match);
- reverse: "abc>" -> "cba", 2..4 letters from a-f (verifiable by exact match);
- preference: arithmetic prompts with the correct sum as `chosen` and a near
  miss as `rejected`, so a reward model trained on it agrees with the rule;
- coding: "Write a Python function `f(x)` that ..." -> the asserts that test it
  (scored by the `sandboxed_python` rule), with a reference `solution`. Not one
  a tiny model learns: it exercises the sandboxed reward's data path (no `sft`);
- calculator: "What is 37*86?" -> "3182", two-digit products a tiny model cannot
  compute in its head but can with the `calculator` tool (docs/agentic.md). Its
  `sft` demonstrations are conversations (`messages`, JSON text): a share of them
  call the calculator and answer with its result, the rest answer directly
  (`direct`: every problem answered without the tool, for the no-tools twin).
  Its byte-level tokenizer and chat template go to calculator_tokenizer/.
Each verifiable task has an `sft` split of demonstrations for a warm-up.
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import random

OUT_DIR = pathlib.Path(__file__).resolve().parents[1] / "jaxrlhf" / "data" / "bundled"
SEED = 20240601
NUM_SFT = 256


def _split(rows: list[dict], test_fraction: float, rng: random.Random) -> tuple[list[dict], list[dict]]:
    rows = list(rows)
    rng.shuffle(rows)
    n_test = max(1, int(len(rows) * test_fraction))
    return rows[n_test:], rows[:n_test]


def arithmetic(rng: random.Random) -> dict[str, list[dict]]:
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(30) for b in range(30)]
    train, test = _split(rows, 0.1, rng)
    return {"train": train, "test": test, "sft": rng.sample(train, NUM_SFT)}


def reverse(rng: random.Random) -> dict[str, list[dict]]:
    letters = "abcdef"
    words = ["".join(p) for n in (2, 3, 4) for p in itertools.product(letters, repeat=n)]
    rows = [{"prompt": f"{w}>", "answer": w[::-1]} for w in words]
    train, test = _split(rows, 0.1, rng)
    return {"train": train, "test": test, "sft": rng.sample(train, NUM_SFT)}


def preference(rng: random.Random) -> dict[str, list[dict]]:
    rows = []
    for a in range(30):
        for b in range(30):
            wrong = a + b + rng.choice([-3, -2, -1, 1, 2, 3, 10])
            wrong = wrong if wrong >= 0 else a + b + 1
            rows.append({"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(wrong)})
    train, test = _split(rows, 0.1, rng)
    return {"train": train, "test": test}


# Coding: (signature, what it does, reference solution, tests). The tests are hand-written expected values,
# so a reference solution scoring 1.0 checks both (tests/data/test_coding_task.py).
CODING_PROBLEMS = [
    ("reverse_list(xs)", "returns the list xs in reverse order",
     "def reverse_list(xs):\n    return xs[::-1]\n",
     "assert reverse_list([1, 2, 3]) == [3, 2, 1]\nassert reverse_list([]) == []\nassert reverse_list([5]) == [5]\n"
     "assert reverse_list(['a', 'b']) == ['b', 'a']\n"),
    ("sum_of_digits(n)", "returns the sum of the decimal digits of the non-negative integer n",
     "def sum_of_digits(n):\n    return sum(int(d) for d in str(n))\n",
     "assert sum_of_digits(0) == 0\nassert sum_of_digits(123) == 6\nassert sum_of_digits(9999) == 36\n"
     "assert sum_of_digits(505) == 10\n"),
    ("is_palindrome(s)", "returns True when the string s reads the same forwards and backwards, else False",
     "def is_palindrome(s):\n    return s == s[::-1]\n",
     "assert is_palindrome('racecar') is True\nassert is_palindrome('ab') is False\nassert is_palindrome('') is True\n"
     "assert is_palindrome('abba') is True\nassert is_palindrome('abca') is False\n"),
    ("fizzbuzz(n)", "returns 'FizzBuzz' when n is divisible by 15, 'Fizz' when by 3, 'Buzz' when by 5, else str(n)",
     "def fizzbuzz(n):\n    if n % 15 == 0:\n        return 'FizzBuzz'\n    if n % 3 == 0:\n        return 'Fizz'\n"
     "    if n % 5 == 0:\n        return 'Buzz'\n    return str(n)\n",
     "assert fizzbuzz(15) == 'FizzBuzz'\nassert fizzbuzz(9) == 'Fizz'\nassert fizzbuzz(10) == 'Buzz'\n"
     "assert fizzbuzz(7) == '7'\n"),
    ("factorial(n)", "returns n! for an integer n >= 0",
     "def factorial(n):\n    result = 1\n    for k in range(2, n + 1):\n        result *= k\n    return result\n",
     "assert factorial(0) == 1\nassert factorial(1) == 1\nassert factorial(5) == 120\nassert factorial(10) == 3628800\n"),
    ("fibonacci(n)", "returns the n-th Fibonacci number, with fibonacci(0) == 0 and fibonacci(1) == 1",
     "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
     "assert fibonacci(0) == 0\nassert fibonacci(1) == 1\nassert fibonacci(2) == 1\nassert fibonacci(10) == 55\n"
     "assert fibonacci(20) == 6765\n"),
    ("count_vowels(s)", "returns how many vowels (a, e, i, o, u, in either case) the string s holds",
     "def count_vowels(s):\n    return sum(c in 'aeiouAEIOU' for c in s)\n",
     "assert count_vowels('hello') == 2\nassert count_vowels('') == 0\nassert count_vowels('AEIOU') == 5\n"
     "assert count_vowels('rhythm') == 0\n"),
    ("largest(xs)", "returns the largest element of the non-empty list xs",
     "def largest(xs):\n    return max(xs)\n",
     "assert largest([3, 1, 2]) == 3\nassert largest([-5, -2, -9]) == -2\nassert largest([7]) == 7\n"),
    ("is_prime(n)", "returns True when the integer n is a prime number, else False",
     "def is_prime(n):\n    if n < 2:\n        return False\n    return all(n % k for k in range(2, int(n ** 0.5) + 1))\n",
     "assert is_prime(2) is True\nassert is_prime(1) is False\nassert is_prime(0) is False\nassert is_prime(17) is True\n"
     "assert is_prime(21) is False\nassert is_prime(97) is True\n"),
    ("gcd(a, b)", "returns the greatest common divisor of the positive integers a and b",
     "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a\n",
     "assert gcd(12, 18) == 6\nassert gcd(7, 5) == 1\nassert gcd(100, 10) == 10\nassert gcd(9, 9) == 9\n"),
    ("count_words(s)", "returns the number of whitespace-separated words in the string s",
     "def count_words(s):\n    return len(s.split())\n",
     "assert count_words('hello world') == 2\nassert count_words('') == 0\nassert count_words('  a  b c ') == 3\n"
     "assert count_words('one') == 1\n"),
    ("capitalize_words(s)", "returns s with the first letter of every space-separated word in upper case",
     "def capitalize_words(s):\n    return ' '.join(w[:1].upper() + w[1:] for w in s.split(' '))\n",
     "assert capitalize_words('hello world') == 'Hello World'\nassert capitalize_words('a') == 'A'\n"
     "assert capitalize_words('') == ''\n"),
    ("remove_duplicates(xs)", "returns xs without repeated elements, keeping the first of each in order",
     "def remove_duplicates(xs):\n    seen = []\n    for x in xs:\n        if x not in seen:\n            seen.append(x)\n"
     "    return seen\n",
     "assert remove_duplicates([1, 2, 1, 3, 2]) == [1, 2, 3]\nassert remove_duplicates([]) == []\n"
     "assert remove_duplicates(['a', 'a']) == ['a']\n"),
    ("flatten(xss)", "returns the lists in the list xss joined into one list (one level deep)",
     "def flatten(xss):\n    return [x for xs in xss for x in xs]\n",
     "assert flatten([[1, 2], [3], []]) == [1, 2, 3]\nassert flatten([]) == []\n"
     "assert flatten([[1], [2, [3]]]) == [1, 2, [3]]\n"),
    ("second_largest(xs)", "returns the second largest distinct value of xs (which holds at least two)",
     "def second_largest(xs):\n    return sorted(set(xs))[-2]\n",
     "assert second_largest([1, 3, 2]) == 2\nassert second_largest([5, 5, 4]) == 4\nassert second_largest([-1, -2]) == -2\n"),
    ("celsius_to_fahrenheit(c)", "returns the temperature c in degrees Celsius converted to Fahrenheit",
     "def celsius_to_fahrenheit(c):\n    return c * 9 / 5 + 32\n",
     "assert celsius_to_fahrenheit(0) == 32\nassert celsius_to_fahrenheit(100) == 212\n"
     "assert celsius_to_fahrenheit(-40) == -40\nassert abs(celsius_to_fahrenheit(37) - 98.6) < 1e-9\n"),
    ("count_char(s, c)", "returns how many times the character c occurs in the string s",
     "def count_char(s, c):\n    return s.count(c)\n",
     "assert count_char('banana', 'a') == 3\nassert count_char('', 'x') == 0\nassert count_char('aaa', 'b') == 0\n"),
    ("reverse_words(s)", "returns the space-separated words of s in reverse order, joined by single spaces",
     "def reverse_words(s):\n    return ' '.join(reversed(s.split()))\n",
     "assert reverse_words('hello world') == 'world hello'\nassert reverse_words('a b c') == 'c b a'\n"
     "assert reverse_words('one') == 'one'\n"),
    ("is_anagram(a, b)", "returns True when the strings a and b hold the same characters the same number of times",
     "def is_anagram(a, b):\n    return sorted(a) == sorted(b)\n",
     "assert is_anagram('listen', 'silent') is True\nassert is_anagram('abc', 'abd') is False\n"
     "assert is_anagram('aab', 'abb') is False\nassert is_anagram('', '') is True\n"),
    ("running_sum(xs)", "returns the list of running totals of xs (the i-th is the sum of xs[0..i])",
     "def running_sum(xs):\n    out, total = [], 0\n    for x in xs:\n        total += x\n        out.append(total)\n"
     "    return out\n",
     "assert running_sum([1, 2, 3]) == [1, 3, 6]\nassert running_sum([]) == []\nassert running_sum([5, -5, 5]) == [5, 0, 5]\n"),
    ("digits_to_int(digits)", "returns the integer whose decimal digits, most significant first, are the list digits",
     "def digits_to_int(digits):\n    n = 0\n    for d in digits:\n        n = 10 * n + d\n    return n\n",
     "assert digits_to_int([1, 2, 3]) == 123\nassert digits_to_int([0]) == 0\nassert digits_to_int([9, 0, 1]) == 901\n"),
    ("is_power_of_two(n)", "returns True when the integer n is a power of two (1, 2, 4, 8, ...), else False",
     "def is_power_of_two(n):\n    return n > 0 and n & (n - 1) == 0\n",
     "assert is_power_of_two(1) is True\nassert is_power_of_two(2) is True\nassert is_power_of_two(6) is False\n"
     "assert is_power_of_two(1024) is True\nassert is_power_of_two(0) is False\n"),
    ("clamp(x, lo, hi)", "returns x limited to the range lo..hi",
     "def clamp(x, lo, hi):\n    return min(max(x, lo), hi)\n",
     "assert clamp(5, 0, 10) == 5\nassert clamp(-3, 0, 10) == 0\nassert clamp(12, 0, 10) == 10\n"),
    ("count_evens(xs)", "returns how many even integers the list xs holds",
     "def count_evens(xs):\n    return sum(x % 2 == 0 for x in xs)\n",
     "assert count_evens([1, 2, 3, 4]) == 2\nassert count_evens([]) == 0\nassert count_evens([0, -2, 7]) == 2\n"),
    ("merge_sorted(a, b)", "returns one sorted list holding the elements of the sorted lists a and b",
     "def merge_sorted(a, b):\n    return sorted(a + b)\n",
     "assert merge_sorted([1, 3, 5], [2, 4]) == [1, 2, 3, 4, 5]\nassert merge_sorted([], [1]) == [1]\n"
     "assert merge_sorted([1, 1], [1]) == [1, 1, 1]\n"),
    ("chunk(xs, n)", "returns xs split into consecutive lists of n elements (the last may be shorter)",
     "def chunk(xs, n):\n    return [xs[i:i + n] for i in range(0, len(xs), n)]\n",
     "assert chunk([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]\nassert chunk([], 3) == []\n"
     "assert chunk([1, 2], 2) == [[1, 2]]\n"),
    ("caesar(s, k)", "returns s with every lower-case letter shifted k places along the alphabet, wrapping from z "
     "to a, and other characters unchanged",
     "def caesar(s, k):\n    return ''.join(chr((ord(c) - 97 + k) % 26 + 97) if 'a' <= c <= 'z' else c for c in s)\n",
     "assert caesar('abc', 1) == 'bcd'\nassert caesar('xyz', 3) == 'abc'\nassert caesar('hi there!', 0) == 'hi there!'\n"
     "assert caesar('a-b', 25) == 'z-a'\n"),
    ("run_length(s)", "returns the run-length encoding of s: each run of a character as the character and the "
     "run's length, e.g. 'aaabcc' -> 'a3b1c2'",
     "def run_length(s):\n    out = ''\n    i = 0\n    while i < len(s):\n        j = i\n        while j < len(s) and s[j] == s[i]:\n"
     "            j += 1\n        out += s[i] + str(j - i)\n        i = j\n    return out\n",
     "assert run_length('aaabcc') == 'a3b1c2'\nassert run_length('') == ''\nassert run_length('x') == 'x1'\n"
     "assert run_length('abab') == 'a1b1a1b1'\n"),
    ("to_binary(n)", "returns the binary digits of the non-negative integer n as a string, without a prefix",
     "def to_binary(n):\n    return bin(n)[2:]\n",
     "assert to_binary(0) == '0'\nassert to_binary(5) == '101'\nassert to_binary(8) == '1000'\n"
     "assert to_binary(255) == '11111111'\n"),
    ("mean(xs)", "returns the arithmetic mean of the non-empty list of numbers xs",
     "def mean(xs):\n    return sum(xs) / len(xs)\n",
     "assert mean([1, 2, 3]) == 2\nassert mean([4]) == 4\nassert mean([1, 2]) == 1.5\n"),
    ("median(xs)", "returns the median of the non-empty list of numbers xs (the mean of the two middle values when "
     "its length is even)",
     "def median(xs):\n    s = sorted(xs)\n    mid = len(s) // 2\n    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2\n",
     "assert median([3, 1, 2]) == 2\nassert median([4, 1, 3, 2]) == 2.5\nassert median([7]) == 7\n"),
    ("transpose(m)", "returns the transpose of the matrix m, given as a list of rows of equal length",
     "def transpose(m):\n    return [list(col) for col in zip(*m)]\n",
     "assert transpose([[1, 2], [3, 4]]) == [[1, 3], [2, 4]]\nassert transpose([[1, 2, 3]]) == [[1], [2], [3]]\n"
     "assert transpose([]) == []\n"),
    ("word_lengths(s)", "returns the lengths of the whitespace-separated words of s, in order",
     "def word_lengths(s):\n    return [len(w) for w in s.split()]\n",
     "assert word_lengths('hi there') == [2, 5]\nassert word_lengths('') == []\nassert word_lengths('a bb ccc') == [1, 2, 3]\n"),
    ("longest_word(s)", "returns the longest whitespace-separated word of s (the first of them on a tie)",
     "def longest_word(s):\n    return max(s.split(), key=len)\n",
     "assert longest_word('a bb ccc') == 'ccc'\nassert longest_word('hello world') == 'hello'\n"
     "assert longest_word('one') == 'one'\n"),
    ("is_sorted(xs)", "returns True when the list xs is in non-decreasing order, else False",
     "def is_sorted(xs):\n    return all(a <= b for a, b in zip(xs, xs[1:]))\n",
     "assert is_sorted([1, 2, 2, 3]) is True\nassert is_sorted([3, 1]) is False\nassert is_sorted([]) is True\n"),
    ("swap_case(s)", "returns s with its upper-case letters in lower case and its lower-case letters in upper case",
     "def swap_case(s):\n    return s.swapcase()\n",
     "assert swap_case('Hello') == 'hELLO'\nassert swap_case('') == ''\nassert swap_case('a1B') == 'A1b'\n"),
    ("sum_of_squares(n)", "returns 1*1 + 2*2 + ... + n*n for an integer n >= 0",
     "def sum_of_squares(n):\n    return sum(k * k for k in range(n + 1))\n",
     "assert sum_of_squares(0) == 0\nassert sum_of_squares(1) == 1\nassert sum_of_squares(3) == 14\n"
     "assert sum_of_squares(10) == 385\n"),
    ("index_of(xs, x)", "returns the index of the first occurrence of x in the list xs, or -1 when there is none",
     "def index_of(xs, x):\n    return xs.index(x) if x in xs else -1\n",
     "assert index_of([1, 2, 3], 2) == 1\nassert index_of([1, 2, 3], 4) == -1\nassert index_of([5, 5], 5) == 0\n"
     "assert index_of([], 1) == -1\n"),
    ("count_digits(n)", "returns how many decimal digits the non-negative integer n has",
     "def count_digits(n):\n    return len(str(n))\n",
     "assert count_digits(0) == 1\nassert count_digits(7) == 1\nassert count_digits(10) == 2\n"
     "assert count_digits(12345) == 5\n"),
    ("triangle_type(a, b, c)", "returns 'equilateral', 'isosceles' or 'scalene' for a triangle with sides a, b and c",
     "def triangle_type(a, b, c):\n    sides = len({a, b, c})\n    return {1: 'equilateral', 2: 'isosceles', 3: 'scalene'}[sides]\n",
     "assert triangle_type(2, 2, 2) == 'equilateral'\nassert triangle_type(2, 2, 3) == 'isosceles'\n"
     "assert triangle_type(3, 2, 2) == 'isosceles'\nassert triangle_type(3, 4, 5) == 'scalene'\n"),
    ("digital_root(n)", "returns the single digit left after summing the digits of the non-negative integer n "
     "again and again",
     "def digital_root(n):\n    while n >= 10:\n        n = sum(int(d) for d in str(n))\n    return n\n",
     "assert digital_root(0) == 0\nassert digital_root(16) == 7\nassert digital_root(942) == 6\n"
     "assert digital_root(132189) == 6\n"),
    ("count_pairs(xs, target)", "returns how many pairs of positions i < j have xs[i] + xs[j] == target",
     "def count_pairs(xs, target):\n    return sum(xs[i] + xs[j] == target for i in range(len(xs)) for j in range(i + 1, len(xs)))\n",
     "assert count_pairs([1, 2, 3, 4], 5) == 2\nassert count_pairs([1, 1, 1], 2) == 3\nassert count_pairs([], 0) == 0\n"),
    ("rotate_left(xs, k)", "returns the list xs rotated left by k places (k may exceed its length)",
     "def rotate_left(xs, k):\n    if not xs:\n        return []\n    k %= len(xs)\n    return xs[k:] + xs[:k]\n",
     "assert rotate_left([1, 2, 3, 4], 1) == [2, 3, 4, 1]\nassert rotate_left([1, 2, 3], 3) == [1, 2, 3]\n"
     "assert rotate_left([1, 2, 3], 4) == [2, 3, 1]\nassert rotate_left([], 2) == []\n"),
    ("remove_vowels(s)", "returns s without its vowels (a, e, i, o, u, in either case)",
     "def remove_vowels(s):\n    return ''.join(c for c in s if c not in 'aeiouAEIOU')\n",
     "assert remove_vowels('hello') == 'hll'\nassert remove_vowels('AEIOUx') == 'x'\nassert remove_vowels('') == ''\n"),
    ("min_max(xs)", "returns the tuple (smallest, largest) of the non-empty list xs",
     "def min_max(xs):\n    return min(xs), max(xs)\n",
     "assert min_max([3, 1, 2]) == (1, 3)\nassert min_max([5]) == (5, 5)\nassert min_max([-1, 4, 0]) == (-1, 4)\n"),
    ("is_leap_year(year)", "returns True when year is a leap year of the Gregorian calendar, else False",
     "def is_leap_year(year):\n    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)\n",
     "assert is_leap_year(2000) is True\nassert is_leap_year(1900) is False\nassert is_leap_year(2024) is True\n"
     "assert is_leap_year(2023) is False\n"),
    ("count_distinct(s)", "returns how many different characters the string s holds",
     "def count_distinct(s):\n    return len(set(s))\n",
     "assert count_distinct('hello') == 4\nassert count_distinct('') == 0\nassert count_distinct('aaa') == 1\n"),
    ("invert_dict(d)", "returns a dict mapping each value of the dict d to its key (the values are distinct)",
     "def invert_dict(d):\n    return {v: k for k, v in d.items()}\n",
     "assert invert_dict({'a': 1, 'b': 2}) == {1: 'a', 2: 'b'}\nassert invert_dict({}) == {}\n"),
    ("char_counts(s)", "returns a dict mapping each character of s to how many times it occurs",
     "def char_counts(s):\n    counts = {}\n    for c in s:\n        counts[c] = counts.get(c, 0) + 1\n    return counts\n",
     "assert char_counts('aab') == {'a': 2, 'b': 1}\nassert char_counts('') == {}\n"),
    ("matrix_sum(m)", "returns the sum of all the numbers in the list of lists m",
     "def matrix_sum(m):\n    return sum(sum(row) for row in m)\n",
     "assert matrix_sum([[1, 2], [3]]) == 6\nassert matrix_sum([]) == 0\nassert matrix_sum([[], [-1]]) == -1\n"),
    ("sort_numbers(xs)", "returns the numbers of xs in ascending order, leaving the list xs itself unchanged",
     "def sort_numbers(xs):\n    return sorted(xs)\n",
     "def test_leaves_its_argument_unchanged():\n    xs = [3, 1, 2]\n    assert sort_numbers(xs) == [1, 2, 3]\n"
     "    assert xs == [3, 1, 2]\n\n\nassert sort_numbers([]) == []\nassert sort_numbers([2, -1, 2]) == [-1, 2, 2]\n"),
]


def coding(rng: random.Random) -> dict[str, list[dict]]:
    rows = [{"prompt": f"Write a Python function `{signature}` that {what}. Answer with the code in a ```python block.",
             "answer": tests, "solution": solution}
            for signature, what, solution, tests in CODING_PROBLEMS]
    del rng  # every fifth problem held out: the split does not depend on the task's place in GENERATORS
    return {"train": [r for i, r in enumerate(rows) if i % 5], "test": rows[::5]}


CALCULATOR_TOOL_SHARE = 0.4  # demonstrations that call the tool; the rest answer directly (RL's room to improve)


def calculator(rng: random.Random) -> dict[str, list[dict]]:
    """Two-digit products; the demonstrations are message lists as JSON text (TFDS stores text fields)."""
    rng = random.Random(f"{SEED}-calculator")  # its own seed: the data does not depend on its place in GENERATORS
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    rows = [{"prompt": f"What is {a}*{b}?", "answer": str(a * b), "messages": "", "direct": ""}
            for a, b in rng.sample(pairs, 1200)]  # every split has the builder's fields; prompts have no demos
    train, test = _split(rows, 1 / 12, rng)
    sft = []
    for row in rng.sample(train, 400):
        user = {"role": "user", "content": row["prompt"]}
        answer = {"role": "assistant", "content": row["answer"]}
        expression = row["prompt"].removeprefix("What is ").removesuffix("?")
        call = {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}]}
        result = {"role": "tool", "name": "calculator", "content": row["answer"]}
        with_tool = [user, call, result, answer] if rng.random() < CALCULATOR_TOOL_SHARE else [user, answer]
        sft.append({**row, "messages": json.dumps(with_tool), "direct": json.dumps([user, answer])})
    return {"train": train, "test": test, "sft": sft}


# task name -> generator of {split: rows}; file names are <task>_<split>.jsonl.
GENERATORS = {"arithmetic": arithmetic, "reverse": reverse, "preference": preference, "coding": coding,
              "calculator": calculator}

# The calculator task's chat template: ChatML turns between two special tokens, the tools listed in one compact
# system line, calls written as Hermes' <tool_call>{json}</tool_call> (environments/tool_calls.py parses them), so a
# byte-level model's prompts and trajectories stay short.
CALCULATOR_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:"
    "{%- for tool in tools %} {{ tool.function.name }}({{ tool.function.parameters.properties | list | join(',') }})"
    "{%- endfor %}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{%- for call in message.tool_calls or [] %}<tool_call>{\"name\":{{ call.function.name | tojson }},"
    "\"arguments\":{{ call.function.arguments | tojson(separators=(',', ':')) }}}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CALCULATOR_SPECIAL = ("<|im_start|>", "<|im_end|>")


def calculator_tokenizer() -> dict[str, str]:
    """A byte-level tokenizer.json (the 256 bytes, no merges) with the template's two special tokens, its
    tokenizer_config.json (EOS = <|im_end|>, which ends a turn) and chat_template.jinja."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    others = [b for b in range(256) if b not in printable]  # GPT-2's byte -> character map (ByteLevel's alphabet)
    char = {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}
    special = {token: i for i, token in enumerate(CALCULATOR_SPECIAL)}
    vocab = {**special, **{char[b]: len(special) + b for b in range(256)}}  # byte b -> id b + 2
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CALCULATOR_SPECIAL])
    config = {"eos_token": "<|im_end|>", "pad_token": "<|im_end|>", "model_max_length": 512,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    return {"tokenizer.json": json.dumps(json.loads(raw.to_str()), indent=1, sort_keys=True) + "\n",
            "tokenizer_config.json": json.dumps(config, indent=2, sort_keys=True) + "\n",
            "chat_template.jinja": CALCULATOR_TEMPLATE}


def render() -> dict[str, str]:
    """All bundled files as {file name: JSONL text}; a fresh RNG per task keeps tasks independent."""
    files = {}
    for index, (task, generate) in enumerate(GENERATORS.items()):
        for split, rows in generate(random.Random(SEED + index)).items():
            lines = (json.dumps(row, sort_keys=True) for row in rows)
            files[f"{task}_{split}.jsonl"] = "".join(line + "\n" for line in lines)
    return files


def render_tokenizers() -> dict[str, str]:
    """The bundled tokenizer folders' files as {relative path: text}."""
    return {f"calculator_tokenizer/{name}": text for name, text in calculator_tokenizer().items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=OUT_DIR)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    total = 0
    for name, text in {**render(), **render_tokenizers()}.items():
        (args.out / name).parent.mkdir(parents=True, exist_ok=True)
        (args.out / name).write_text(text, encoding="utf-8")
        total += len(text.encode())
        print(f"wrote {args.out / name} ({text.count(chr(10))} rows)")
    print(f"total {total / 1024:.1f} KiB")


if __name__ == "__main__":
    main()
