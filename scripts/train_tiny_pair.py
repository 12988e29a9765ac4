"""Train the tiny Qwen2 chat pair that ships inside mini-infer (appendix: the tiny model).

    .venv/bin/python scripts/train_tiny_pair.py            # writes mini_infer/models/tiny{,-draft}

One run, deterministic from ``--seed``, builds everything from nothing on a CPU:

1. the synthetic chat corpus (``mini_infer.tiny_corpus``), held-out questions excluded;
2. a Qwen-style byte-level BPE tokenizer trained on it (``mini_infer.offline_models``);
3. two Qwen2 models, a target and a draft about a quarter of its size, trained with AdamW
   (warm-up, then cosine decay; gradient clipping; bf16 autocast) on the assistant tokens only,
   closing ``<|im_end|>`` included, so that the models learn when to stop;
4. each model in Hugging Face layout, bf16 weights, with its training log
   (``training_log.jsonl``), its evaluation (``eval_results.json``, from
   ``scripts/eval_tiny_pair.py``) and a model card (``README.md``).

About 25 minutes on two CPU cores (target 21, draft 5). Same seed, same thread count: same
corpus, same tokenizer, same initial weights and the same batches (CPU kernels are
deterministic for a fixed thread count, so in practice the same weights too).
"""

from __future__ import annotations

import os

# Set before torch loads OpenMP: threads that wait at a barrier sleep instead of spinning. On a
# 2-core machine shared with other work, spinning made a training step 4x slower.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import importlib.util
import json
import math
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import Qwen2Config, Qwen2ForCausalLM

import mini_infer
from mini_infer import tiny_corpus
from mini_infer.chat_template import ENDOFTEXT, IM_END
from mini_infer.offline_models import ModelShape, build_tokenizer, qwen2_config_dict

MODELS_DIR = Path(mini_infer.__file__).parent / "models"
IGNORE = -100  # label of a token that carries no loss (system and user turns, padding)
TOKENIZER_VOCAB = 1000  # the corpus has few distinct words: BPE stops near 760 on its own
VOCAB_MULTIPLE = 64  # the model's vocabulary is padded up, as Qwen2.5 pads 151,665 to 151,936


@dataclass(frozen=True)
class TrainSettings:
    """Hyper-parameters of one model's run."""

    steps: int
    batch_size: int = 48  # conversations per step: about 96 assistant turns, 3,500 tokens
    lr: float = 1e-3
    warmup_steps: int = 200
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    weight_decay: float = 0.1  # on matrices only, not on norms or biases
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    log_every: int = 10
    eval_every: int = 250


def target_shape(vocab_size: int) -> ModelShape:
    """About 3.4M parameters: hidden 256, 4 layers, 4 query heads over 2 KV heads."""
    return ModelShape(256, 768, 4, 4, 2, vocab_size, max_position_embeddings=2048, rope_theta=10_000.0)


def draft_shape(vocab_size: int) -> ModelShape:
    """About a quarter of the target: half the width, the same depth and head layout."""
    return ModelShape(128, 384, 4, 4, 2, vocab_size, max_position_embeddings=2048, rope_theta=10_000.0)


# --- Data -------------------------------------------------------------------------------------


def assistant_spans(text: str, messages: list[tiny_corpus.Message]) -> list[tuple[int, int]]:
    """Character spans of each assistant reply in the rendered ``text``, closing ``<|im_end|>``
    included (the model must learn to stop), the newline after it not."""
    spans, cursor = [], 0
    for message in messages:
        if message["role"] != "assistant":
            continue
        header = "<|im_start|>assistant\n"
        start = text.index(header + message["content"] + IM_END, cursor) + len(header)
        cursor = start + len(message["content"]) + len(IM_END)
        spans.append((start, cursor))
    return spans


Example = tuple[torch.Tensor, torch.Tensor]  # token ids and labels of one conversation, int16
ENCODE_CHUNK = 4096  # conversations tokenized at once: bounds the memory the offsets take


def encode_corpus(tokenizer: Any, conversations: list[list[tiny_corpus.Message]]) -> list[Example]:
    """Token ids and labels of every conversation; labels are ``IGNORE`` outside assistant replies.
    Stored as int16 tensors: Python lists of ints took 3.5 GB for the whole corpus, and a shared
    machine's out-of-memory killer picks the biggest process."""
    assert len(tokenizer) < 2**15
    examples: list[Example] = []
    for chunk_start in range(0, len(conversations), ENCODE_CHUNK):
        chunk = conversations[chunk_start : chunk_start + ENCODE_CHUNK]
        texts = [tokenizer.apply_chat_template(c, tokenize=False) for c in chunk]
        encoded = tokenizer(texts, return_offsets_mapping=True, add_special_tokens=False)
        for text, messages, ids, offsets in zip(texts, chunk, encoded["input_ids"], encoded["offset_mapping"]):
            spans = assistant_spans(text, messages)
            labels = [
                token if any(s <= begin and end <= e for s, e in spans) else IGNORE
                for token, (begin, end) in zip(ids, offsets)
            ]
            examples.append((torch.tensor(ids, dtype=torch.int16), torch.tensor(labels, dtype=torch.int16)))
    # The masked tokens must spell out exactly the replies: a check on the offsets logic.
    for (_, stored), messages in zip(examples[:50], conversations[:50]):
        kept = tokenizer.decode([t for t in stored.tolist() if t != IGNORE])
        assert kept == "".join(m["content"] + IM_END for m in messages if m["role"] == "assistant"), kept
    return examples


def length_grouped_batches(
    lengths: list[int], batch_size: int, num_batches: int, rng: random.Random
) -> list[list[int]]:
    """Indices of ``num_batches`` batches: shuffled, then sorted by length within windows of 50
    batches, so that a batch pads little; the batch order is shuffled again afterwards."""
    batches: list[list[int]] = []
    while len(batches) < num_batches:
        order = list(range(len(lengths)))
        rng.shuffle(order)
        window = 50 * batch_size
        for w in range(0, len(order) - batch_size + 1, window):
            chunk = sorted(order[w : w + window], key=lengths.__getitem__)
            batches.extend(chunk[i : i + batch_size] for i in range(0, len(chunk) - batch_size + 1, batch_size))
    batches = batches[:num_batches]
    rng.shuffle(batches)
    return batches


PAD_MULTIPLE = 8


def collate(examples: list[Example], indices: list[int], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids`` and ``labels``. No attention mask: with causal attention, padding
    at the end is never attended to by the real tokens before it, and it carries no loss.
    Widths are rounded up to a multiple of 8: a new tensor shape at almost every step made the
    process's memory grow steadily (from 3.6 to 6 GB in 2,000 steps)."""
    width = -(-max(len(examples[i][0]) for i in indices) // PAD_MULTIPLE) * PAD_MULTIPLE
    ids = torch.full((len(indices), width), pad_id)
    labels = torch.full((len(indices), width), IGNORE)
    for row, i in enumerate(indices):
        tokens, targets = examples[i]
        ids[row, : len(tokens)] = tokens
        labels[row, : len(targets)] = targets
    return ids, labels


# --- Training ---------------------------------------------------------------------------------


def learning_rate(step: int, s: TrainSettings) -> float:
    """Linear warm-up to ``s.lr``, then cosine decay to ``s.lr * s.min_lr_ratio``."""
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    progress = (step - s.warmup_steps) / max(1, s.steps - s.warmup_steps)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def new_model(config: dict[str, Any], seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**config)).float()
    model.config.use_cache = False
    return model


@torch.no_grad()
def mean_loss(model: Qwen2ForCausalLM, examples: list[Example], pad_id: int) -> float:
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(examples), 64):
        ids, labels = collate(examples, list(range(start, min(start + 64, len(examples)))), pad_id)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            n = int((labels[:, 1:] != IGNORE).sum())
            total += float(model(input_ids=ids, labels=labels).loss) * n
        count += n
    model.train()
    return total / count


def train(
    name: str,
    model: Qwen2ForCausalLM,
    settings: TrainSettings,
    examples: list[Example],
    held_out: list[Example],
    pad_id: int,
    seed: int,
    log_path: Path,
) -> float:
    """Train ``model`` in place, write its log as JSON lines, return the wall time in seconds."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=settings.lr,
        betas=settings.betas,
    )
    batches = length_grouped_batches(
        [len(e[0]) for e in examples], settings.batch_size, settings.steps, random.Random(seed)
    )
    model.train()
    start, window = time.time(), []
    with log_path.open("w") as log:
        for step, indices in enumerate(batches):
            lr = learning_rate(step, settings)
            for group in optimizer.param_groups:
                group["lr"] = lr
            ids, labels = collate(examples, indices, pad_id)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            window.append(loss.item())
            last = step + 1 == settings.steps
            if (step + 1) % settings.log_every == 0 or last:
                record: dict[str, Any] = {
                    "model": name,
                    "step": step + 1,
                    "loss": round(sum(window) / len(window), 5),
                    "lr": lr,
                    "elapsed_s": round(time.time() - start, 1),
                }
                window = []
                if (step + 1) % settings.eval_every == 0 or last:
                    record["held_out_loss"] = round(mean_loss(model, held_out, pad_id), 5)
                log.write(json.dumps(record) + "\n")
                log.flush()
                print(json.dumps(record), flush=True)
    return time.time() - start


# --- Saving -----------------------------------------------------------------------------------


def save_model(model: Qwen2ForCausalLM, config: dict[str, Any], tokenizer: Any, directory: Path) -> None:
    """Hugging Face layout with bf16 weights; the tied ``lm_head`` is not stored, as in Qwen2.5."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: tensor.detach().to(torch.bfloat16).contiguous()
        for name, tensor in model.state_dict().items()
        if name != "lm_head.weight"
    }
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    eos_ids = [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(ENDOFTEXT)]
    generation_config = {"eos_token_id": eos_ids, "pad_token_id": eos_ids[1], "do_sample": False}
    (directory / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    tokenizer.save_pretrained(str(directory))
    make_tokenizer_config_portable(directory)


def make_tokenizer_config_portable(directory: Path) -> None:
    """Let ``transformers`` 4.x load the tokenizer too (Colab and Kaggle may ship it).

    ``transformers`` 5 writes ``"tokenizer_class": "TokenizersBackend"``, a class 4.x does not
    have, lists the special tokens under ``extra_special_tokens`` (a dict in 4.x), and keeps the
    chat template only in ``chat_template.jinja`` (which 4.x before 4.50 does not read). Both
    versions read the spelling below; 5.x loads it exactly as before.
    """
    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if isinstance(config.get("extra_special_tokens"), list):
        config["additional_special_tokens"] = config.pop("extra_special_tokens")
    config["chat_template"] = (directory / "chat_template.jinja").read_text()
    path.write_text(json.dumps(config, indent=2) + "\n")


def load_eval_script() -> Any:
    path = Path(__file__).with_name("eval_tiny_pair.py")
    spec = importlib.util.spec_from_file_location("eval_tiny_pair", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def example_questions() -> list[tiny_corpus.Question]:
    """One question per task, for the model card."""
    return [
        tiny_corpus.arithmetic_question("addition", 34, 57, 0),
        tiny_corpus.arithmetic_question("subtraction", 23, 45, 0),
        tiny_corpus.list_question("copy", ["cat", "dog", "sun"], 0),
        tiny_corpus.list_question("reverse", ["cat", "dog", "sun"], 0),
        tiny_corpus.list_question("count", ["cat", "cat", "sun"], 1),
        tiny_corpus.capital_question("Peru", 0),
    ]


def model_card(role: str, info: dict[str, Any], results: dict[str, Any], eval_module: Any) -> str:
    """The README.md of one model: data, architecture, training, evaluation, license."""
    shape, settings = info["shape"], info["settings"]
    other = "tiny-draft" if role == "target" else "tiny"
    purpose = (
        "the target model of mini-infer's tiny pair: a chat model small enough to train on a "
        "laptop CPU in minutes, and right often enough that an inference engine's output can be "
        "checked by reading it."
        if role == "target"
        else "the draft model of mini-infer's tiny pair: about a quarter of the target "
        "(`tiny`), with the same tokenizer, for speculative decoding."
    )
    lines = [
        "---",
        "license: apache-2.0",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "tags: [qwen2, tiny, synthetic-data, education, mini-infer]",
        "---",
        "",
        f"# mini-infer {'tiny' if role == 'target' else 'tiny-draft'}",
        "",
        f"A {info['params'] / 1e6:.2f}M-parameter Qwen2 chat model: {purpose} Its pair is `{other}`. It "
        "knows six small tasks and nothing else; it is a teaching tool, not an assistant.",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        "tokenizer = AutoTokenizer.from_pretrained(path)",
        "model = AutoModelForCausalLM.from_pretrained(path)",
        'chat = [{"role": "user", "content": "What is 34 + 57?"}]',
        "ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors='pt', return_dict=True)",
        "out = model.generate(**ids, max_new_tokens=32, do_sample=False)",
        "print(tokenizer.decode(out[0, ids['input_ids'].shape[1]:], skip_special_tokens=True))  # 34 + 57 = 91.",
        "```",
        "",
        "## Data",
        "",
        "Synthetic chats from `mini_infer/tiny_corpus.py` (seed "
        f"{info['seed']}, {info['num_conversations']:,} conversations of one to four turns, two "
        "on average), rendered with the Qwen-style chat template (default system prompt "
        '"You are a helpful assistant."):',
        "",
        "| task | example question | reply |",
        "|---|---|---|",
        *(f"| {q.task} | {q.prompt} | {q.answer} |" for q in example_questions()),
        "",
        "Operands are two-digit numbers (10-99); lists have 2-6 words (2-9 for counting) from "
        f"a {len(tiny_corpus.WORDS)}-word vocabulary; the capitals are a table of "
        f"{len(tiny_corpus.CAPITALS)} countries stated in the corpus module. Each task has 5-8 "
        "phrasings of the question. Held-out questions never appear in training: 200 addition "
        "pairs {A, B} (in either order), 100 subtraction pairs, 100 word lists for each list task, "
        "and for every country two phrasings it is never asked in.",
        "",
        "## Architecture",
        "",
        "`Qwen2ForCausalLM`: "
        f"hidden size {shape['hidden_size']}, {shape['num_hidden_layers']} layers, "
        f"{shape['num_attention_heads']} query heads over {shape['num_key_value_heads']} key/value heads "
        f"(grouped-query attention, head dim {shape['hidden_size'] // shape['num_attention_heads']}), "
        f"SwiGLU MLP of width {shape['intermediate_size']}, q/k/v biases, RMSNorm, RoPE (theta "
        f"{shape['rope_theta']:g}), tied input and output embeddings, vocabulary {shape['vocab_size']} "
        f"(the tokenizer has {info['tokenizer_size']} tokens; the rest is padding, as in Qwen2.5). "
        f"{info['params']:,} parameters, stored in bfloat16.",
        "",
        "The tokenizer is a byte-level BPE trained on the corpus by "
        "`mini_infer.offline_models.build_tokenizer`: Qwen2's pre-tokenizer (digits split one by "
        "one), Qwen2.5's special tokens `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` and tool-call "
        "tokens; end of turn is `<|im_end|>`.",
        "",
        "## Training",
        "",
        f"{settings['steps']} steps of {settings['batch_size']} conversations, AdamW (betas "
        f"{tuple(settings['betas'])}, weight decay {settings['weight_decay']} on matrices), learning rate "
        f"{settings['lr']:g} after a {settings['warmup_steps']}-step linear warm-up, cosine decay to "
        f"{settings['lr'] * settings['min_lr_ratio']:g}, gradient clipping at {settings['grad_clip']}, bf16 autocast, "
        "loss on the assistant tokens only (the closing `<|im_end|>` included). "
        f"{info['train_time_s'] / 60:.1f} minutes on {info['threads']} CPU threads "
        f"(torch {torch.__version__}); final training loss {info['final_loss']:.4f}, held-out loss "
        f"{info['final_held_out_loss']:.4f}. The log is `training_log.jsonl` (one line per "
        f"{settings['log_every']} steps: step, loss, lr, elapsed seconds; held-out loss every "
        f"{settings['eval_every']} steps).",
        "",
        f"Reproduce (writes both models): `python scripts/train_tiny_pair.py --seed {info['seed']}`.",
        "",
        "## Evaluation",
        "",
        "Greedy decoding with `transformers` `generate`, the chat template, stopping at "
        "`<|im_end|>`; replies graded by `mini_infer.tiny_corpus.check_answer`. Draft agreement: the "
        "fraction of the target's greedy next tokens that the draft also predicts, teacher-forced "
        "along the target's own replies to the held-out chats (the acceptance rate greedy "
        "speculative decoding sees). `python scripts/eval_tiny_pair.py` prints:",
        "",
        "```text",
        eval_module.format_table(results),
        "```",
        "",
        "## License",
        "",
        "Apache-2.0, as mini-infer. The training data is synthetic, generated by the script above.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=MODELS_DIR, help="writes OUT/tiny and OUT/tiny-draft")
    parser.add_argument("--target-steps", type=int, default=2400)
    parser.add_argument("--draft-steps", type=int, default=1200)
    parser.add_argument(
        "--only",
        choices=["target", "draft"],
        help="retrain one model and keep the other (same corpus and tokenizer: pass the same "
        "--seed and --*-steps as the run that wrote it)",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-eval", action="store_true", help="no evaluation and no evaluation in the cards")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    plans = {
        "target": (target_shape, TrainSettings(steps=args.target_steps, lr=1e-3), args.out / "tiny"),
        "draft": (draft_shape, TrainSettings(steps=args.draft_steps, lr=2e-3), args.out / "tiny-draft"),
    }
    num_conversations = max(s.steps * s.batch_size for _, s, _ in plans.values())
    conversations = tiny_corpus.build_corpus(args.seed, num_conversations)
    tokenizer = build_tokenizer(tiny_corpus.corpus_texts(conversations), TOKENIZER_VOCAB)
    vocab_size = -(-len(tokenizer) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    examples = encode_corpus(tokenizer, conversations)
    del conversations
    held_out_chats = [
        q.messages() + [{"role": "assistant", "content": q.answer}]
        for t in tiny_corpus.TASKS
        for q in tiny_corpus.held_out_questions(t)
    ]
    held_out = encode_corpus(tokenizer, held_out_chats[::3])
    pad_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    eos_ids = [tokenizer.convert_tokens_to_ids(IM_END), pad_id]
    print(
        f"{len(examples)} conversations, tokenizer {len(tokenizer)} tokens, model vocabulary {vocab_size}",
        flush=True,
    )

    infos: dict[str, dict[str, Any]] = {}
    for index, (role, (make_shape, settings, directory)) in enumerate(plans.items()):
        if args.only not in (None, role):
            infos[role] = json.loads((directory / "training_info.json").read_text())
            continue
        shape = make_shape(vocab_size)
        config = qwen2_config_dict(shape, torch_dtype="bfloat16", eos_token_ids=eos_ids)
        model = new_model(config, seed=args.seed * 1000 + index)
        params = sum(p.numel() for p in model.parameters())
        print(f"{role}: {params:,} parameters", flush=True)
        if directory.exists():
            shutil.rmtree(directory)
        directory.mkdir(parents=True)
        log_path = directory / "training_log.jsonl"
        seconds = train(role, model, settings, examples, held_out, pad_id, args.seed * 1000 + index, log_path)
        save_model(model, config, tokenizer, directory)
        last = json.loads(log_path.read_text().splitlines()[-1])
        infos[role] = {
            "shape": asdict(shape),
            "settings": asdict(settings),
            "params": params,
            "seed": args.seed,
            "num_conversations": num_conversations,
            "tokenizer_size": len(tokenizer),
            "train_time_s": seconds,
            "threads": args.threads,
            "final_loss": last["loss"],
            "final_held_out_loss": last["held_out_loss"],
        }
        (directory / "training_info.json").write_text(json.dumps(infos[role], indent=2) + "\n")
        del model

    if args.skip_eval:
        return
    eval_module = load_eval_script()
    results = eval_module.evaluate(plans["target"][2], plans["draft"][2])
    print(eval_module.format_table(results), flush=True)
    for role, (_, _, directory) in plans.items():
        (directory / "eval_results.json").write_text(json.dumps(results, indent=2) + "\n")
        (directory / "README.md").write_text(model_card(role, infos[role], results, eval_module))


if __name__ == "__main__":
    main()
