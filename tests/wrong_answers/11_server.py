"""Chapter 11's exercises answered wrongly, as a student plausibly would (see scripts/wrong_answers.py)."""

WRONG_ANSWERS = {
    "sse-solution": [
        # Lines end only with "\n": a CR line end (and the "\r" before "\n") is left in the data.
        """
events, data = [], []
for line in raw.decode("utf-8", errors="replace").split("\\n") + [""]:
    if not line:
        if data:
            events.append("\\n".join(data))
        data = []
    elif not line.startswith(":"):
        field, _, value = line.partition(":")
        if field == "data":
            data.append(value.removeprefix(" "))
return events
""",
        # Strips all the whitespace around the value instead of one space after the colon.
        """
events, data = [], []
for line in re.split(r"\\r\\n|\\r|\\n", raw.decode("utf-8", errors="replace")) + [""]:
    if not line:
        if data:
            events.append("\\n".join(data))
        data = []
    elif not line.startswith(":"):
        field, _, value = line.partition(":")
        if field == "data":
            data.append(value.strip())
return events
""",
        # Only a blank line ends an event: the last one, not closed, is dropped.
        """
events, data = [], []
for line in re.split(r"\\r\\n|\\r|\\n", raw.decode("utf-8", errors="replace")):
    if not line:
        if data:
            events.append("\\n".join(data))
        data = []
    elif not line.startswith(":"):
        field, _, value = line.partition(":")
        if field == "data":
            data.append(value.removeprefix(" "))
return events
""",
        # servebench's parser: the exercise asks for the parsing itself.
        """
from mini_infer.bench.serve.client import SSEParser

parser = SSEParser()
return [event.data for event in parser.feed(raw) + parser.close()]
""",
    ],
    "openai-error-solution": [
        # A bool passes for a number (True is an int in Python).
        """
checks = [
    ("max_tokens", lambda v: isinstance(v, int) and v >= 1, "must be an integer of at least 1"),
    ("temperature", lambda v: isinstance(v, (int, float)) and 0 <= v <= 2, "must be a number from 0 to 2"),
    ("top_p", lambda v: isinstance(v, (int, float)) and 0 < v <= 1, "must be a number in (0, 1]"),
]
for name, ok, rule in checks:
    value = fields.get(name)
    if value is not None and not ok(value):
        return {"message": f"{name}: {rule}, got {value!r}", "type": "invalid_request_error", "param": name, "code": None}
return None
""",
        # top_p's lower bound included: top_p = 0 is accepted.
        """
def number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)

checks = [
    ("max_tokens", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "must be an integer of at least 1"),
    ("temperature", lambda v: number(v) and 0 <= v <= 2, "must be a number from 0 to 2"),
    ("top_p", lambda v: number(v) and 0 <= v <= 1, "must be a number in [0, 1]"),
]
for name, ok, rule in checks:
    value = fields.get(name)
    if value is not None and not ok(value):
        return {"message": f"{name}: {rule}, got {value!r}", "type": "invalid_request_error", "param": name, "code": None}
return None
""",
        # The fields checked in the body's order, not max_tokens, temperature, top_p.
        """
def number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)

rules = {
    "max_tokens": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "must be an integer of at least 1"),
    "temperature": (lambda v: number(v) and 0 <= v <= 2, "must be a number from 0 to 2"),
    "top_p": (lambda v: number(v) and 0 < v <= 1, "must be a number in (0, 1]"),
}
for name, value in fields.items():
    ok, rule = rules[name]
    if value is not None and not ok(value):
        return {"message": f"{name}: {rule}, got {value!r}", "type": "invalid_request_error", "param": name, "code": None}
return None
""",
        # The server's own validation: the exercise asks for the rules themselves.
        """
from mini_infer.server.protocol import APIError, CompletionRequest, parse_request

try:
    parse_request(CompletionRequest, {"model": "m", "prompt": "hi", **fields})
except APIError as exc:
    return {"message": str(exc), "type": "invalid_request_error", "param": exc.param, "code": None}
return None
""",
    ],
}
