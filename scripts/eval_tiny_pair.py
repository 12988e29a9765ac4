"""Evaluate the tiny pair: greedy accuracy per task, and how often the draft agrees with the target.

    .venv/bin/python scripts/eval_tiny_pair.py [--target DIR] [--draft DIR] [--json PATH]

Accuracy: each held-out question of ``mini_infer.tiny_corpus`` is rendered with the chat
template, answered by ``transformers`` ``generate`` (greedy, stopping at ``<|im_end|>``) and
graded by ``check_answer``. The "multi-turn" row asks held-out questions as the second turn of a
chat whose first exchange is already there.

Agreement: along the target's own greedy reply to every held-out chat (closing ``<|im_end|>``
included), the fraction of positions where the draft's most likely next token is the target's.
That is exactly the acceptance rate of greedy speculative decoding: a draft proposal is accepted
while it equals what the target would have said. From the same match sequence the script also
replays speculative decoding with ``k`` proposals per step and reports the tokens each target
step yields (at most ``k + 1``).
"""

from __future__ import annotations

import os

# Set before torch loads OpenMP: threads that wait at a barrier sleep instead of spinning. On a
# 2-core machine shared with other work, spinning made a training step 4x slower.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

import mini_infer
from mini_infer import tiny_corpus
from mini_infer.chat_template import ENDOFTEXT, IM_END

MODELS_DIR = Path(mini_infer.__file__).parent / "models"
ROWS = (*tiny_corpus.TASKS, "multi-turn")


def held_out_chats() -> dict[str, list[tuple[list[tiny_corpus.Message], tiny_corpus.Question]]]:
    """Every evaluation chat, by row: (messages to send, question they end with)."""
    chats: dict[str, list[tuple[list[tiny_corpus.Message], tiny_corpus.Question]]] = {
        task: [(q.messages(), q) for q in tiny_corpus.held_out_questions(task)] for task in tiny_corpus.TASKS
    }
    chats["multi-turn"] = [(q.messages(history), q) for history, q in tiny_corpus.held_out_conversations()]
    return chats


def load(directory: Path, dtype: torch.dtype) -> tuple[Any, Any]:
    transformers.utils.logging.disable_progress_bar()  # no "Loading weights" bars in the table
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()
    return model, tokenizer


@torch.no_grad()
def greedy_replies(
    model: Any,
    tokenizer: Any,
    chats: Sequence[list[tiny_corpus.Message]],
    batch_size: int,
    max_new_tokens: int,
) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, reply ids) for each chat; a reply ends with its ``<|im_end|>`` when it has one."""
    eos_ids = [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(ENDOFTEXT)]
    prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    order = sorted(range(len(chats)), key=lambda i: len(prompt_ids[i]))  # batches of similar length
    replies: list[list[int]] = [[] for _ in chats]
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        width = max(len(prompt_ids[i]) for i in rows)
        # Left padding: every row's next token is then predicted at the same last position.
        ids = torch.tensor([[eos_ids[1]] * (width - len(prompt_ids[i])) + prompt_ids[i] for i in rows])
        mask = torch.tensor([[0] * (width - len(prompt_ids[i])) + [1] * len(prompt_ids[i]) for i in rows])
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos_ids,
            pad_token_id=eos_ids[1],
        )
        for row, i in enumerate(rows):
            reply = out[row, width:].tolist()
            for end, token in enumerate(reply):
                if token in eos_ids:
                    reply = reply[: end + 1]
                    break
            replies[i] = reply
    return list(zip(prompt_ids, replies))


@torch.no_grad()
def draft_matches(
    draft: Any, sequences: Sequence[tuple[list[int], list[int]]], pad_id: int, batch_size: int
) -> list[list[bool]]:
    """For each (prompt, target reply): does the draft's argmax equal each reply token, given
    everything before it (teacher forcing along the target's reply)?"""
    matches: list[list[bool]] = []
    for start in range(0, len(sequences), batch_size):
        rows = sequences[start : start + batch_size]
        width = max(len(p) + len(r) for p, r in rows)
        # Right padding needs no mask: causal attention never looks at the padding after a token.
        ids = torch.tensor([p + r + [pad_id] * (width - len(p) - len(r)) for p, r in rows])
        predicted = draft(input_ids=ids).logits.argmax(-1)
        for row, (prompt, reply) in enumerate(rows):
            # The token at position t is predicted by the logits at t - 1.
            guesses = predicted[row, len(prompt) - 1 : len(prompt) + len(reply) - 1].tolist()
            matches.append([g == t for g, t in zip(guesses, reply)])
    return matches


def tokens_per_step(matches: Sequence[list[bool]], k: int) -> float:
    """Replay greedy speculative decoding with ``k`` proposals per target step: a step accepts the
    draft's leading matches (at most ``k``) and adds one token of the target's own."""
    tokens = steps = 0
    for reply in matches:
        position = 0
        while position < len(reply):
            accepted = 0
            while accepted < k and position + accepted < len(reply) and reply[position + accepted]:
                accepted += 1
            position += accepted + 1
            steps += 1
        tokens += len(reply)
    return tokens / max(1, steps)


def evaluate(
    target_dir: Path,
    draft_dir: Path | None,
    *,
    dtype: torch.dtype = torch.float32,
    batch_size: int = 50,
    max_new_tokens: int = 40,
    k: int = 4,
) -> dict[str, Any]:
    """Accuracy of each model on every row, and the draft's agreement with the target."""
    start = time.time()
    chats = held_out_chats()
    results: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch."), "rows": {}, "models": {}}
    generated: dict[str, dict[str, list[tuple[list[int], list[int]]]]] = {}
    dirs = {"target": target_dir} if draft_dir is None else {"target": target_dir, "draft": draft_dir}
    loaded = {}
    for role, directory in dirs.items():
        model, tokenizer = load(directory, dtype)
        loaded[role] = (model, tokenizer)
        results["models"][role] = {
            "path": str(directory),
            "params": sum(p.numel() for p in model.parameters()),
        }
        generated[role] = {}
        for row, items in chats.items():
            outputs = greedy_replies(model, tokenizer, [m for m, _ in items], batch_size, max_new_tokens)
            generated[role][row] = outputs
            correct = sum(
                tiny_corpus.check_answer(q, tokenizer.decode(reply, skip_special_tokens=True))
                for (_, q), (_, reply) in zip(items, outputs)
            )
            entry = results["rows"].setdefault(row, {"n": len(items)})
            entry[f"{role}_accuracy"] = correct / len(items)
            if role == "target":
                entry["examples"] = [
                    {"question": q.prompt, "reply": tokenizer.decode(reply, skip_special_tokens=True)}
                    for (_, q), (_, reply) in list(zip(items, outputs))[:3]
                ]
    if draft_dir is not None:
        draft, tokenizer = loaded["draft"]
        pad_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
        all_matches: list[list[bool]] = []
        for row in chats:
            matches = draft_matches(draft, generated["target"][row], pad_id, batch_size)
            all_matches.extend(matches)
            total = sum(len(m) for m in matches)
            results["rows"][row]["agreement"] = sum(map(sum, matches)) / max(1, total)
        total = sum(len(m) for m in all_matches)
        results["agreement"] = sum(map(sum, all_matches)) / max(1, total)
        results["agreement_tokens"] = total
        results["k"] = k
        results["tokens_per_target_step"] = tokens_per_step(all_matches, k)
    results["seconds"] = round(time.time() - start, 1)
    return results


def format_table(results: dict[str, Any]) -> str:
    """The results as a fixed-width text table."""
    has_draft = "agreement" in results
    header = f"{'task':<12} {'n':>4} {'target':>7}" + (f" {'draft':>7} {'agree':>7}" if has_draft else "")
    lines = [header, "-" * len(header)]
    for row in ROWS:
        r = results["rows"][row]
        line = f"{row:<12} {r['n']:>4} {r['target_accuracy']:>7.1%}"
        if has_draft:
            line += f" {r['draft_accuracy']:>7.1%} {r['agreement']:>7.1%}"
        lines.append(line)
    if has_draft:
        lines.append("-" * len(header))
        lines.append(
            f"draft agreement with target: {results['agreement']:.1%} of {results['agreement_tokens']} next tokens; "
            f"speculative decoding with k={results['k']}: {results['tokens_per_target_step']:.2f} tokens per target step"
        )
    params = ", ".join(f"{role} {m['params'] / 1e6:.2f}M" for role, m in results["models"].items())
    lines.append(f"parameters: {params}; greedy, {results['dtype']} compute")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=MODELS_DIR / "tiny")
    parser.add_argument("--draft", type=Path, default=MODELS_DIR / "tiny-draft")
    parser.add_argument("--no-draft", action="store_true", help="evaluate the target alone")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--examples", action="store_true", help="print three replies of the target per task")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = evaluate(args.target, None if args.no_draft else args.draft, dtype=getattr(torch, args.dtype))
    print(format_table(results))
    if args.examples:
        for row in ROWS:
            for example in results["rows"][row]["examples"]:
                print(f"[{row}] {example['question']!r} -> {example['reply']!r}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
