"""The synthetic chat corpus that the tiny trained pair learns from (appendix: the tiny model).

mini-infer never downloads weights, so the book trains its own pair of small Qwen2 chat models
(``scripts/train_tiny_pair.py``): a target and a draft a quarter of its size, for speculative
decoding. This module writes the conversations they learn from, the questions they are tested
on, and the checkers that grade their replies. Every task has an answer a program can check:

=============  ==================================  ====================================
task           a user asks                         the assistant replies
=============  ==================================  ====================================
addition       What is 34 + 57?                    34 + 57 = 91.
subtraction    What is 23 - 45?                    23 - 45 = -22.
copy           Repeat these words: cat, dog, sun.  The list is: cat, dog, sun.
reverse        Reverse this list: cat, dog, sun.   The reversed list is: sun, dog, cat.
count          Count the items: cat, cat, sun.     There are 3 items.
capital        What is the capital of Peru?        The capital of Peru is Lima.
=============  ==================================  ====================================

Questions come in several phrasings; replies have one canonical form per task, so that a tiny
model spends its capacity on the answer rather than on style. Most conversations have two to
four turns (which also spreads the cost of the system prompt over more answers), and a few carry
their own system prompt.

One detail matters more than it seems: byte-level BPE gives ``" dog"`` (after a space) and
``"dog"`` (at the start of a text) different tokens. Every word a reply must copy from the
question therefore follows a space in both places: a list reply starts with "The list is:", and
no phrasing starts with a country's name. A tiny model that had to learn "dog" from " dog" for
every word would copy lists badly.

Invariants (checked in ``tests/test_tiny_corpus.py``):

* Everything is a pure function of a seed: the same seed gives the same corpus.
* The held-out questions are fixed (they do not depend on the training seed) and never appear
  in training. What "the same question" means is its ``key``: the unordered pair {A, B} for
  addition (so B + A is held out with A + B), the ordered pair for subtraction, the exact word
  list for copy, reverse and count, and the pair (country, phrasing) for capitals: every fact is
  taught, but each country is tested only in phrasings it was never taught with.
* ``check_answer`` accepts each question's canonical answer and rejects wrong ones.
"""

from __future__ import annotations

import functools
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

Message = dict[str, str]
Expected = int | tuple[str, ...] | str

TASKS: tuple[str, ...] = ("addition", "subtraction", "copy", "reverse", "count", "capital")

# How often each task is drawn for a training turn: tuned on trial runs, where subtraction
# (borrows, negative results) and copying long lists were the last to be learned, and addition,
# counting and the capitals the first. A 2,000-step run with copy at 0.18 copied only 71% of the
# held-out lists (it skipped or doubled a word) while reversing 99%, hence copy's larger share.
TASK_WEIGHTS: dict[str, float] = {
    "addition": 0.16,
    "subtraction": 0.31,
    "copy": 0.26,
    "reverse": 0.10,
    "count": 0.07,
    "capital": 0.10,
}

# The facts the capital task teaches, stated here and nowhere else.
CAPITALS: dict[str, str] = {
    "France": "Paris",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Germany": "Berlin",
    "Portugal": "Lisbon",
    "Greece": "Athens",
    "Austria": "Vienna",
    "Poland": "Warsaw",
    "Norway": "Oslo",
    "Sweden": "Stockholm",
    "Finland": "Helsinki",
    "Ireland": "Dublin",
    "Egypt": "Cairo",
    "Kenya": "Nairobi",
    "Japan": "Tokyo",
    "China": "Beijing",
    "India": "New Delhi",
    "Thailand": "Bangkok",
    "Peru": "Lima",
    "Chile": "Santiago",
    "Canada": "Ottawa",
    "Australia": "Canberra",
    "Russia": "Moscow",
    "Cuba": "Havana",
}

# Short, common words for the list tasks (none of them a country or a capital).
WORDS: tuple[str, ...] = tuple(
    (
        "apple pear plum lemon grape cat dog cow fox owl bee fish red blue green pink gold tree "
        "rock lake moon star sun rain snow wind boat car bus ship book pen cup hat key bell drum "
        "milk bread rice"
    ).split()
)

TEMPLATES: dict[str, tuple[str, ...]] = {
    "addition": (
        "What is {a} + {b}?",
        "What is {a} plus {b}?",
        "What's {a} + {b}?",
        "Compute {a} + {b}.",
        "Calculate {a} + {b}.",
        "Add {a} and {b}.",
        "{a} + {b} = ?",
        "What is the sum of {a} and {b}?",
    ),
    "subtraction": (
        "What is {a} - {b}?",
        "What is {a} minus {b}?",
        "What's {a} - {b}?",
        "Compute {a} - {b}.",
        "Calculate {a} - {b}.",
        "Subtract {b} from {a}.",
        "{a} - {b} = ?",
        "What is {a} take away {b}?",
    ),
    "copy": (
        "Repeat these words: {items}.",
        "Copy this list: {items}.",
        "Say these words back to me: {items}.",
        "Please repeat: {items}.",
        "Echo the list {items}.",
    ),
    "reverse": (
        "Reverse this list: {items}.",
        "Say these words in reverse order: {items}.",
        "Reverse the order of: {items}.",
        "Write this list backwards: {items}.",
        "What is {items} reversed?",
    ),
    "count": (
        "How many items are in this list: {items}?",
        "Count the items: {items}.",
        "How many words are there in: {items}?",
        "Count these words: {items}.",
        "How many things are listed here: {items}?",
    ),
    "capital": (
        "What is the capital of {country}?",
        "What's the capital city of {country}?",
        "Which city is the capital of {country}?",
        "Name the capital of {country}.",
        "Tell me the capital of {country}.",
        "Which city is {country}'s capital?",
    ),
}

# System prompts a few training conversations carry; the rest get the chat template's default.
SYSTEM_PROMPTS: tuple[str, ...] = (
    "You are a helpful assistant.",
    "You are a concise assistant.",
    "Answer briefly.",
)

HELD_OUT_SEED = 20240601  # fixed: the held-out set must not move when the training seed does
HELD_OUT_SIZES: dict[str, int] = {
    "addition": 200,
    "subtraction": 100,
    "copy": 100,
    "reverse": 100,
    "count": 100,
}
HELD_OUT_PHRASINGS_PER_COUNTRY = 2  # capital: 24 countries x 2 phrasings = 48 questions
NUM_HELD_OUT_CONVERSATIONS = 100

LIST_LENGTHS: dict[str, tuple[int, int]] = {"copy": (2, 6), "reverse": (2, 6), "count": (2, 9)}
TWO_DIGITS = (10, 99)


@dataclass(frozen=True)
class Question:
    """One user question, its canonical reply, and what ``check_answer`` compares against."""

    task: str
    prompt: str
    answer: str
    expected: Expected
    key: tuple[object, ...]  # what makes two questions "the same" for holding out

    def messages(self, history: Sequence[Message] = ()) -> list[Message]:
        """The chat to send to a model: ``history`` and then this question."""
        return [*history, {"role": "user", "content": self.prompt}]

    def exchange(self) -> list[Message]:
        """This question and its canonical answer, as two chat messages."""
        return [{"role": "user", "content": self.prompt}, {"role": "assistant", "content": self.answer}]


# --- Making questions -------------------------------------------------------------------------


def arithmetic_question(task: str, a: int, b: int, template: int) -> Question:
    """``A + B`` or ``A - B`` in phrasing number ``template``."""
    op, value = ("+", a + b) if task == "addition" else ("-", a - b)
    # Addition is commutative: holding out {A, B} must hold out B + A as well.
    key = ("addition", min(a, b), max(a, b)) if task == "addition" else ("subtraction", a, b)
    prompt = TEMPLATES[task][template].format(a=a, b=b)
    return Question(task, prompt, f"{a} {op} {b} = {value}.", value, key)


def list_question(task: str, words: Sequence[str], template: int) -> Question:
    """A copy, reverse or count question about ``words``."""
    items = ", ".join(words)
    prompt = TEMPLATES[task][template].format(items=items)
    expected: Expected
    if task == "copy":
        expected = tuple(words)
        answer = f"The list is: {items}."
    elif task == "reverse":
        expected = tuple(reversed(words))
        answer = "The reversed list is: " + ", ".join(expected) + "."
    elif task == "count":
        expected = len(words)
        answer = f"There are {len(words)} items."
    else:
        raise ValueError(f"not a list task: {task!r}")
    return Question(task, prompt, answer, expected, (task, *words))


def capital_question(country: str, template: int) -> Question:
    """Ask for the capital of ``country`` in phrasing number ``template``."""
    capital = CAPITALS[country]
    prompt = TEMPLATES["capital"][template].format(country=country)
    return Question(
        "capital", prompt, f"The capital of {country} is {capital}.", capital, ("capital", country, template)
    )


def random_question(rng: random.Random, task: str) -> Question:
    """A question of ``task`` drawn from the whole space, held-out ones included."""
    template = rng.randrange(len(TEMPLATES[task]))
    if task in ("addition", "subtraction"):
        return arithmetic_question(task, rng.randint(*TWO_DIGITS), rng.randint(*TWO_DIGITS), template)
    if task in LIST_LENGTHS:
        n = rng.randint(*LIST_LENGTHS[task])
        # Counting allows repeats (it counts items, not distinct words); copy and reverse do not,
        # so that a reply in the wrong order is always visibly wrong.
        words = [rng.choice(WORDS) for _ in range(n)] if task == "count" else rng.sample(WORDS, n)
        return list_question(task, words, template)
    if task == "capital":
        return capital_question(rng.choice(sorted(CAPITALS)), template)
    raise ValueError(f"unknown task {task!r}")


# --- The held-out questions -------------------------------------------------------------------


@functools.cache
def held_out_questions(task: str) -> tuple[Question, ...]:
    """The fixed evaluation questions of ``task``; none of them appears in training."""
    rng = random.Random(f"{HELD_OUT_SEED}-{task}")
    if task == "capital":
        questions = []
        for country in sorted(CAPITALS):
            for template in rng.sample(range(len(TEMPLATES["capital"])), HELD_OUT_PHRASINGS_PER_COUNTRY):
                questions.append(capital_question(country, template))
        return tuple(questions)
    chosen: dict[tuple[object, ...], Question] = {}
    while len(chosen) < HELD_OUT_SIZES[task]:
        question = random_question(rng, task)
        chosen.setdefault(question.key, question)
    return tuple(chosen.values())


@functools.cache
def held_out_keys() -> frozenset[tuple[object, ...]]:
    """The keys of every held-out question, of every task."""
    return frozenset(q.key for task in TASKS for q in held_out_questions(task))


@functools.cache
def held_out_conversations() -> tuple[tuple[tuple[Message, ...], Question], ...]:
    """Two-turn evaluation chats: a first exchange with its correct answer, then a held-out
    question of another task. Tests that a model answers the last turn, not an earlier one."""
    rng = random.Random(f"{HELD_OUT_SEED}-conversations")
    chats = []
    for i in range(NUM_HELD_OUT_CONVERSATIONS):
        task = TASKS[i % len(TASKS)]
        first_task = rng.choice([t for t in TASKS if t != task])
        first = rng.choice(held_out_questions(first_task))
        chats.append((tuple(first.exchange()), rng.choice(held_out_questions(task))))
    return tuple(chats)


# --- The training corpus ----------------------------------------------------------------------


def sample_question(rng: random.Random, task: str | None = None) -> Question:
    """A training question: of ``task`` (or of a task drawn by ``TASK_WEIGHTS``), never held out."""
    if task is None:
        task = rng.choices(list(TASK_WEIGHTS), weights=list(TASK_WEIGHTS.values()))[0]
    excluded = held_out_keys()
    while True:
        question = random_question(rng, task)
        if question.key not in excluded:
            return question


def sample_conversation(rng: random.Random) -> list[Message]:
    """One training chat: one to four exchanges, sometimes after an explicit system prompt."""
    messages: list[Message] = []
    if rng.random() < 0.1:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    num_turns = rng.choices([1, 2, 3, 4], weights=[0.4, 0.3, 0.2, 0.1])[0]
    for _ in range(num_turns):
        messages.extend(sample_question(rng).exchange())
    return messages


def build_corpus(seed: int, num_conversations: int) -> list[list[Message]]:
    """``num_conversations`` training chats, a pure function of ``seed``."""
    rng = random.Random(seed)
    return [sample_conversation(rng) for _ in range(num_conversations)]


def corpus_texts(conversations: Iterable[Sequence[Message]]) -> list[str]:
    """The plain texts a tokenizer should learn from: every message and every role name.
    (Not the rendered chats: their special tokens are not text to be merged.)"""
    texts = ["system", "user", "assistant"]
    for conversation in conversations:
        texts.extend(message["content"] for message in conversation)
    return texts


# --- Grading ----------------------------------------------------------------------------------

_INTEGER = re.compile(r"-?\d+")
_WORD = re.compile(r"[A-Za-z]+")


def check_answer(question: Question, reply: str) -> bool:
    """Is ``reply`` a correct answer to ``question``?

    Graded on content, not on exact wording: arithmetic by the last number of the reply (and,
    if the reply restates the sum, by its operands too), lists by their words in order (after
    the last colon, if there is one), counts
    by the first number, capitals by naming the right city and no other capital.
    """
    if question.task in ("addition", "subtraction"):
        numbers = [int(n) for n in _INTEGER.findall(reply)]
        if not numbers or numbers[-1] != question.expected:
            return False
        operands = [int(n) for n in _INTEGER.findall(question.prompt)]
        if question.prompt.startswith("Subtract"):  # "Subtract B from A." states A - B backwards
            operands.reverse()
        return len(numbers) < 3 or numbers[:2] == operands
    if question.task in ("copy", "reverse"):
        listed = reply.rsplit(":", 1)[-1]  # the words after a lead-in such as "The list is:"
        return tuple(w.lower() for w in _WORD.findall(listed)) == question.expected
    if question.task == "count":
        numbers = _INTEGER.findall(reply)
        return bool(numbers) and int(numbers[0]) == question.expected
    if question.task == "capital":
        named = {city for city in CAPITALS.values() if re.search(rf"\b{city}\b", reply, re.IGNORECASE)}
        return named == {question.expected}
    raise ValueError(f"unknown task {question.task!r}")
