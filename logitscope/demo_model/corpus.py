"""Deterministic synthetic corpus for the logitscope demo model.

The demo model only has to be good enough to make logits *interesting* to
look at: structured text where the next token is nearly certain (JSON keys,
punctuation, arithmetic results, phone-number digits) mixed with text where
many continuations are plausible (names, cities, prose).  This module writes
such a corpus from fixed word lists and templates, so it needs no download and
is exactly reproducible from a seed.

Four kinds of documents are mixed:

1. JSON records of people, e.g. ``{"name": "Alice Moreau", "age": 34, "city": "Lyon"}``;
2. sentences with phone numbers, e.g. ``Call Maria at 555-0134.``;
3. small, always-correct arithmetic, e.g. ``(8 - 3) * 2 = 10``;
4. short template prose about people, cities, weather, pets and work.

Every document ends with :data:`EOT`.
"""

from __future__ import annotations

import json
import random
import unicodedata
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = ["EOT", "iter_documents", "write_corpus"]

#: End-of-text token appended to every document (also the tokenizer's eos/bos/pad).
EOT = "<|endoftext|>"

FIRST_NAMES: tuple[str, ...] = (
    "Alice",
    "Maria",
    "John",
    "Sophie",
    "Lucas",
    "Emma",
    "Noah",
    "Olivia",
    "Liam",
    "Chloé",
    "Hugo",
    "Léa",
    "Jonas",
    "Mia",
    "Paul",
    "Anna",
    "David",
    "Sarah",
    "Omar",
    "Yuki",
    "Kenji",
    "Fatima",
    "Ivan",
    "Elena",
    "Marco",
    "Giulia",
    "Pedro",
    "Lucía",
    "Thomas",
    "Julia",
    "Ahmed",
    "Nina",
    "Samuel",
    "Clara",
    "Felix",
    "Ingrid",
    "Raj",
    "Priya",
    "Tom",
    "Zoë",
    "Max",
    "Eva",
    "Leon",
    "Hannah",
    "Victor",
    "Laura",
    "Oscar",
    "Rosa",
)

LAST_NAMES: tuple[str, ...] = (
    "Moreau",
    "Smith",
    "Garcia",
    "Müller",
    "Rossi",
    "Dubois",
    "Novak",
    "Tanaka",
    "Kowalski",
    "Jensen",
    "Silva",
    "Martin",
    "Brown",
    "Lopez",
    "Petit",
    "Costa",
    "Schmidt",
    "Nguyen",
    "Khan",
    "Ivanova",
    "Bernard",
    "Fischer",
    "Santos",
    "Weber",
    "Laurent",
    "Meyer",
    "Ricci",
    "Hansen",
    "Kim",
    "Chen",
    "Wilson",
    "Taylor",
    "Fontaine",
    "Bauer",
    "Romano",
    "Larsen",
    "Patel",
    "Sato",
    "Haddad",
    "Olsen",
)

CITIES: tuple[str, ...] = (
    "Lyon",
    "Paris",
    "Berlin",
    "Madrid",
    "Rome",
    "Lisbon",
    "Vienna",
    "Prague",
    "Oslo",
    "Dublin",
    "London",
    "Zürich",
    "Geneva",
    "Milan",
    "Munich",
    "Hamburg",
    "Barcelona",
    "Porto",
    "Warsaw",
    "Krakow",
    "Budapest",
    "Athens",
    "Tokyo",
    "Osaka",
    "Seoul",
    "Boston",
    "Chicago",
    "Denver",
    "Seattle",
    "Austin",
    "Toronto",
    "Montreal",
    "Sydney",
    "Melbourne",
    "Cairo",
    "Nairobi",
    "Lima",
    "Bogotá",
    "Marseille",
    "Nantes",
)

JOBS: tuple[str, ...] = (
    "teacher",
    "engineer",
    "nurse",
    "baker",
    "doctor",
    "pilot",
    "writer",
    "designer",
    "chef",
    "farmer",
    "lawyer",
    "painter",
    "student",
    "musician",
    "librarian",
    "plumber",
    "architect",
    "developer",
)

EMAIL_DOMAINS: tuple[str, ...] = ("example.com", "mail.org", "post.net", "inbox.io")

WEATHER: tuple[str, ...] = (
    "sunny",
    "rainy",
    "cloudy",
    "windy",
    "cold",
    "warm",
    "foggy",
    "snowy",
    "hot",
)

PETS: tuple[str, ...] = ("cat", "dog")
PET_NAMES: tuple[str, ...] = (
    "Milo",
    "Luna",
    "Bella",
    "Max",
    "Oscar",
    "Coco",
    "Simba",
    "Daisy",
    "Rex",
    "Nala",
)
PET_ACTIONS: dict[str, tuple[str, ...]] = {
    "cat": (
        "sleeps on the sofa",
        "chases a mouse",
        "purrs loudly",
        "watches the birds",
        "sits by the window",
        "ignores everyone",
    ),
    "dog": (
        "barks at the mailman",
        "runs in the park",
        "chases a ball",
        "wags its tail",
        "sleeps by the door",
        "digs in the garden",
    ),
}
DAYS: tuple[str, ...] = (
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
)
TIMES: tuple[str, ...] = ("in the morning", "in the afternoon", "in the evening", "at night")
ACTIVITIES: tuple[str, ...] = (
    "reads a book",
    "cooks dinner",
    "goes for a walk",
    "visits a friend",
    "works late",
    "plays the piano",
    "drinks coffee",
    "takes the train",
    "writes a letter",
    "watches a film",
)
FEELINGS: tuple[str, ...] = ("happy", "tired", "busy", "calm", "excited", "bored")


def _ascii(text: str) -> str:
    """Drop accents (``"Zoë Müller"`` -> ``"Zoe Muller"``), as e-mail addresses usually do."""
    return unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")


def _json_record(rng: random.Random) -> str:
    """A JSON object describing a person; key order varies a little."""
    first, last = rng.choice(FIRST_NAMES), rng.choice(LAST_NAMES)
    record: dict[str, object] = {"name": f"{first} {last}", "age": rng.randint(18, 90)}
    tail: list[tuple[str, object]] = [("city", rng.choice(CITIES))]
    if rng.random() < 0.35:
        tail.append(("job", rng.choice(JOBS)))
    if rng.random() < 0.3:
        user = _ascii(f"{first}.{last}").lower()
        tail.append(("email", f"{user}@{rng.choice(EMAIL_DOMAINS)}"))
    if rng.random() < 0.25:
        rng.shuffle(tail)
    record.update(tail)
    if rng.random() < 0.15:  # occasionally put the age first
        record = {"age": record["age"], **{k: v for k, v in record.items() if k != "age"}}
    return json.dumps(record, ensure_ascii=False)


def _phone_number(rng: random.Random) -> str:
    fmt = rng.randrange(4)
    if fmt == 0:
        return f"555-{rng.randint(0, 9999):04d}"
    if fmt == 1:
        return f"({rng.randint(200, 999)}) {rng.randint(200, 999)}-{rng.randint(0, 9999):04d}"
    if fmt == 2:
        return f"{rng.randint(200, 999)}-{rng.randint(200, 999)}-{rng.randint(0, 9999):04d}"
    return f"+1 {rng.randint(200, 999)} {rng.randint(200, 999)} {rng.randint(0, 9999):04d}"


def _phone_sentence(rng: random.Random) -> str:
    name = rng.choice(FIRST_NAMES)
    phone = _phone_number(rng)
    pronoun = rng.choice(("Her", "His", "Their"))
    templates = (
        f"Call {name} at {phone}.",
        f"{pronoun} phone number is {phone}.",
        f"You can reach {name} at {phone}.",
        f"{name}'s number is {phone}.",
        f"Please call {phone} to talk to {name}.",
        f"For questions, call {phone}.",
    )
    return rng.choice(templates)


def _arithmetic(rng: random.Random) -> str:
    """One correct equation with small non-negative integers.

    Operands stay small (0-10, times tables up to 9) so that a 1 M-parameter
    model has a chance to learn the facts; the results are always computed,
    never sampled.  Parenthesised two-step equations are kept rare.
    """
    kind = rng.choices(range(5), weights=(35, 25, 25, 8, 7))[0]
    a, b = rng.randint(0, 10), rng.randint(0, 10)
    if kind == 0:
        return f"{a} + {b} = {a + b}"
    if kind == 1:
        a, b = max(a, b), min(a, b)
        return f"{a} - {b} = {a - b}"
    if kind == 2:
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        return f"{a} * {b} = {a * b}"
    c = rng.randint(2, 4)
    if kind == 3:
        a, b = max(a, b), min(a, b)
        return f"({a} - {b}) * {c} = {(a - b) * c}"
    return f"({a} + {b}) * {c} = {(a + b) * c}"


def _prose_sentence(rng: random.Random) -> str:
    name, city = rng.choice(FIRST_NAMES), rng.choice(CITIES)
    pet = rng.choice(PETS)
    templates: tuple[Callable[[], str], ...] = (
        lambda: f"{name} lives in {city}.",
        lambda: f"{name} works as a {rng.choice(JOBS)} in {city}.",
        lambda: f"It is {rng.choice(WEATHER)} in {city} today.",
        lambda: f"The weather in {city} is {rng.choice(WEATHER)} on {rng.choice(DAYS)}.",
        lambda: f"On {rng.choice(DAYS)}, {name} {rng.choice(ACTIVITIES)}.",
        lambda: f"{name} {rng.choice(ACTIVITIES)} {rng.choice(TIMES)}.",
        lambda: f"{name} has a {pet} called {rng.choice(PET_NAMES)}.",
        lambda: f"The {pet} {rng.choice(PET_ACTIONS[pet])}.",
        lambda: f"{rng.choice(PET_NAMES)} the {pet} {rng.choice(PET_ACTIONS[pet])}.",
        lambda: f"{name} feels {rng.choice(FEELINGS)} because it is {rng.choice(WEATHER)}.",
        lambda: f"{name} moved from {city} to {rng.choice(CITIES)} last year.",
        lambda: f"{name} and {rng.choice(FIRST_NAMES)} are friends.",
        lambda: f"Every {rng.choice(DAYS)}, {name} takes the {pet} for a walk.",
    )
    return rng.choice(templates)()


def _prose(rng: random.Random) -> str:
    return " ".join(_prose_sentence(rng) for _ in range(rng.randint(2, 4)))


def _lines(rng: random.Random, make: Callable[[random.Random], str], max_lines: int = 4) -> str:
    """1 to ``max_lines`` items of one kind, one per line, so documents have some length."""
    return "\n".join(make(rng) for _ in range(rng.randint(1, max_lines)))


# (weight, maker).  Arithmetic gets the most lines: its facts are the hardest
# thing in the corpus for a tiny model to learn.
_KINDS: tuple[tuple[float, Callable[[random.Random], str]], ...] = (
    (0.28, lambda rng: _lines(rng, _json_record)),
    (0.20, lambda rng: _lines(rng, _phone_sentence)),
    (0.30, lambda rng: _lines(rng, _arithmetic, max_lines=6)),
    (0.22, _prose),
)


def _check_args(n_docs: int, seed: int) -> None:
    if not isinstance(n_docs, int) or isinstance(n_docs, bool):
        raise TypeError(f"n_docs must be an int, got {type(n_docs).__name__}")
    if n_docs < 1:
        raise ValueError(f"n_docs must be >= 1, got {n_docs}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")


def iter_documents(n_docs: int, seed: int = 0) -> Iterator[str]:
    """Yield ``n_docs`` documents, each ending with :data:`EOT`.

    The output depends only on ``n_docs`` and ``seed`` (a private
    ``random.Random(seed)`` drives every choice), so the same arguments always
    give the same text.
    """
    _check_args(n_docs, seed)
    rng = random.Random(seed)
    weights = [w for w, _ in _KINDS]
    makers = [m for _, m in _KINDS]
    for _ in range(n_docs):
        make = rng.choices(makers, weights=weights)[0]
        yield make(rng) + EOT


def write_corpus(path: str | Path, n_docs: int, seed: int = 0) -> Path:
    """Write ``n_docs`` documents to ``path`` (UTF-8, one document per line group).

    Documents are separated only by their trailing :data:`EOT` plus a newline,
    so the file can be fed straight to a tokenizer trainer.  Returns the path.
    """
    path = Path(path)
    _check_args(n_docs, seed)
    with path.open("w", encoding="utf-8") as f:
        for doc in iter_documents(n_docs, seed):
            f.write(doc)
            f.write("\n")
    return path
