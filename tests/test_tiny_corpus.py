"""Tests of the tiny pair's synthetic corpus: determinism, held-out separation, grading."""

from __future__ import annotations

import random

import pytest

from mini_infer import tiny_corpus as tc


def all_questions(seed: int, n: int) -> list[tc.Question]:
    rng = random.Random(seed)
    return [tc.sample_question(rng) for _ in range(n)]


def test_corpus_is_a_function_of_the_seed() -> None:
    assert tc.build_corpus(3, 200) == tc.build_corpus(3, 200)
    assert tc.build_corpus(3, 200) != tc.build_corpus(4, 200)


def test_conversations_alternate_user_and_assistant() -> None:
    for conversation in tc.build_corpus(0, 300):
        turns = conversation[1:] if conversation[0]["role"] == "system" else conversation
        assert 2 <= len(turns) <= 8
        assert [m["role"] for m in turns] == ["user", "assistant"] * (len(turns) // 2)


def test_every_task_and_several_turns_occur() -> None:
    corpus = tc.build_corpus(0, 2000)
    assert any(len(c) >= 4 for c in corpus)
    assert any(c[0]["role"] == "system" for c in corpus)
    replies = [m["content"] for c in corpus for m in c if m["role"] == "assistant"]
    assert any(" + " in r for r in replies) and any(" - " in r for r in replies)
    assert any(r.startswith("There are ") for r in replies)
    assert any(r.startswith("The list is: ") for r in replies)
    assert any(r.startswith("The reversed list is: ") for r in replies)
    assert any(r.startswith("The capital of ") for r in replies)


def test_held_out_sets_are_fixed_and_sized() -> None:
    assert len(tc.held_out_questions("addition")) == 200
    for task in ("subtraction", "copy", "reverse", "count"):
        assert len(tc.held_out_questions(task)) == 100
    assert len(tc.held_out_questions("capital")) == len(tc.CAPITALS) * tc.HELD_OUT_PHRASINGS_PER_COUNTRY
    for task in tc.TASKS:
        questions = tc.held_out_questions(task)
        assert len({q.key for q in questions}) == len(questions)
        assert all(q.task == task for q in questions)
    assert len(tc.held_out_conversations()) == tc.NUM_HELD_OUT_CONVERSATIONS


def test_held_out_questions_never_appear_in_training() -> None:
    held_out = tc.held_out_keys()
    trained = {q.key for q in all_questions(0, 20_000)}
    assert not trained & held_out
    held_out_prompts = {q.prompt for task in tc.TASKS for q in tc.held_out_questions(task)}
    corpus_prompts = {m["content"] for c in tc.build_corpus(0, 5000) for m in c if m["role"] == "user"}
    assert not corpus_prompts & held_out_prompts


def test_addition_holds_out_both_orders() -> None:
    trained = {(q.prompt, q.answer) for q in all_questions(1, 20_000) if q.task == "addition"}
    held_pairs = {q.key[1:] for q in tc.held_out_questions("addition")}  # keys hold (min, max)
    for _, answer in trained:
        a, _, b = answer.split(" = ")[0].split(" ")
        assert (min(int(a), int(b)), max(int(a), int(b))) not in held_pairs


def test_every_country_and_phrasing_is_still_taught() -> None:
    taught = {q.key for q in all_questions(0, 20_000) if q.task == "capital"}
    assert {key[1] for key in taught} == set(tc.CAPITALS)
    assert {key[2] for key in taught} == set(range(len(tc.TEMPLATES["capital"])))


def test_copied_words_follow_a_space_in_question_and_reply() -> None:
    # BPE tokenizes " dog" and "dog" differently; a reply copies tokens only if both have the space.
    for task in ("copy", "reverse", "count", "capital"):
        for template in tc.TEMPLATES[task]:
            assert " {" in template and not template.startswith("{"), template
    for question in tc.held_out_questions("copy") + tc.held_out_questions("reverse"):
        assert isinstance(question.expected, tuple)
        assert all(f" {word}" in question.answer for word in question.expected)


@pytest.mark.parametrize("task", tc.TASKS)
def test_checker_accepts_canonical_answers(task: str) -> None:
    for question in tc.held_out_questions(task):
        assert tc.check_answer(question, question.answer), question


@pytest.mark.parametrize(
    ("question", "reply", "ok"),
    [
        (tc.arithmetic_question("addition", 34, 57, 0), "34 + 57 = 91.", True),
        (tc.arithmetic_question("addition", 34, 57, 0), "91", True),
        (tc.arithmetic_question("addition", 34, 57, 0), "34 + 57 = 81.", False),
        (tc.arithmetic_question("addition", 34, 57, 0), "34 + 75 = 91.", False),  # wrong operands
        (tc.arithmetic_question("addition", 34, 57, 0), "", False),
        (tc.arithmetic_question("subtraction", 23, 45, 0), "23 - 45 = -22.", True),
        (tc.arithmetic_question("subtraction", 23, 45, 0), "23 - 45 = 22.", False),
        (tc.arithmetic_question("subtraction", 23, 45, 5), "23 - 45 = -22.", True),  # "Subtract 45 from 23."
        (tc.list_question("copy", ["cat", "dog", "sun"], 0), "The list is: cat, dog, sun.", True),
        (tc.list_question("copy", ["cat", "dog", "sun"], 0), "cat, dog, sun.", True),
        (tc.list_question("copy", ["cat", "dog", "sun"], 0), "The list is: cat, dog, sun, sun.", False),
        (tc.list_question("copy", ["cat", "dog", "sun"], 0), "cat, sun, dog.", False),
        (tc.list_question("copy", ["cat", "dog", "sun"], 0), "cat, dog.", False),
        (tc.list_question("reverse", ["cat", "dog", "sun"], 0), "The reversed list is: sun, dog, cat.", True),
        (tc.list_question("reverse", ["cat", "dog", "sun"], 0), "sun, dog, cat.", True),
        (tc.list_question("reverse", ["cat", "dog", "sun"], 0), "cat, dog, sun.", False),
        (tc.list_question("count", ["cat", "cat", "sun"], 0), "There are 3 items.", True),
        (tc.list_question("count", ["cat", "cat", "sun"], 0), "There are 2 items.", False),
        (tc.list_question("count", ["cat", "cat", "sun"], 0), "There are items.", False),
        (tc.capital_question("Peru", 0), "The capital of Peru is Lima.", True),
        (tc.capital_question("Peru", 0), "The capital of Peru is Santiago.", False),
        (tc.capital_question("Peru", 0), "Lima or Santiago.", False),
        (tc.capital_question("India", 0), "The capital of India is New Delhi.", True),
    ],
)
def test_checker_grades_content(question: tc.Question, reply: str, ok: bool) -> None:
    assert tc.check_answer(question, reply) is ok


def test_corpus_texts_cover_messages_and_roles() -> None:
    corpus = tc.build_corpus(0, 10)
    texts = tc.corpus_texts(corpus)
    assert {"system", "user", "assistant"} <= set(texts)
    assert all(m["content"] in texts for c in corpus for m in c)
