"""Appendix A1's exercises answered wrongly, as a student plausibly would (see scripts/wrong_answers.py)."""

WRONG_ANSWERS = {
    "grade-addition-solution": [
        # The first integer of the reply, which is usually the first operand restated.
        """
numbers = re.findall(r"-?\\d+", reply)
return bool(numbers) and int(numbers[0]) == a + b
""",
        # The sum appears anywhere in the reply: "12? No: 13." is graded right.
        "return str(a + b) in reply",
        # Digits only: a negative sum loses its sign.
        """
numbers = re.findall(r"\\d+", reply)
return bool(numbers) and int(numbers[-1]) == a + b
""",
        # Calls the corpus's own grader.
        "return tiny_corpus.check_answer(tiny_corpus.arithmetic_question('addition', a, b, 0), reply)",
    ],
    "loss-mask-solution": [
        # Everything but the user's tokens: the system prompt is trained on too.
        'return [0 if role == "user" else 1 for role, n in turns for _ in range(n)]',
        # One flag per turn instead of one per token.
        'return [1 if role == "assistant" else 0 for role, n in turns]',
        # Shifts the flags by one, mixing up the mask with next-token labels.
        """
flags = [1 if role == "assistant" else 0 for role, n in turns for _ in range(n)]
return flags[1:] + [0] if flags else []
""",
    ],
}
