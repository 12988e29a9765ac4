"""Chapter 13's exercises answered wrongly, as a student plausibly would (see scripts/wrong_answers.py)."""

WRONG_ANSWERS = {
    "kv-blocks-solution": [
        # Forgets the factor 2: only the keys are counted, not the values.
        """
per_block = sum(c.num_hidden_layers * c.num_key_value_heads * block_size * c.head_dim * itemsize for c in configs)
return min(budget_bytes // per_block, max_num_seqs * -(-max_model_len // block_size))
""",
        # Only the first model's cache: the draft's share of every block is forgotten.
        """
c = configs[0]
per_block = 2 * c.num_hidden_layers * c.num_key_value_heads * block_size * c.head_dim * itemsize
return min(budget_bytes // per_block, max_num_seqs * -(-max_model_len // block_size))
""",
        # Floor instead of ceiling: a sequence's partly filled last block is not counted in the cap.
        """
per_block = sum(2 * c.num_hidden_layers * c.num_key_value_heads * block_size * c.head_dim * itemsize for c in configs)
return min(budget_bytes // per_block, max_num_seqs * (max_model_len // block_size))
""",
        # The package's sizing: the exercise asks for the arithmetic itself.
        """
dtype = {2: torch.float16, 4: torch.float32}[itemsize]
return kv_blocks_for_memory(configs, block_size=block_size, dtype=dtype, device=torch.device("cpu"),
                            max_num_seqs=max_num_seqs, max_model_len=max_model_len, kv_cache_memory=budget_bytes)
""",
    ],
    "without-drafts-solution": [
        # Ignores the model's defaults: only the request's fields, else vLLM's.
        """
def value(name):
    return given.get(name, getattr(SamplingParams(), name))

penalties = value("repetition_penalty") != 1.0 or value("presence_penalty") != 0.0 or value("frequency_penalty") != 0.0
return penalties or given.get("logprobs") is not None
""",
        # The model's defaults win over the request's own fields.
        """
def value(name):
    return model_defaults[name] if name in model_defaults else given.get(name, getattr(SamplingParams(), name))

penalties = value("repetition_penalty") != 1.0 or value("presence_penalty") != 0.0 or value("frequency_penalty") != 0.0
return penalties or given.get("logprobs") is not None
""",
        # `logprobs=0` read as "no logprobs": it still asks for the sampled token's logprob.
        """
def value(name):
    return given[name] if name in given else model_defaults.get(name, getattr(SamplingParams(), name))

penalties = value("repetition_penalty") != 1.0 or value("presence_penalty") != 0.0 or value("frequency_penalty") != 0.0
return penalties or bool(given.get("logprobs"))
""",
        # The engine's own rule: the exercise asks for it to be written.
        """
params = SamplingParams(**given).with_defaults(model_defaults)
return params.needs_penalties or params.logprobs is not None
""",
    ],
    "decode-ceiling-solution": [
        # Counts the embedding table too, as if a step read all of it.
        """
h, i = config.hidden_size, config.intermediate_size
per_layer = h * (config.q_size + 2 * config.kv_size) + config.q_size * h + 3 * h * i
return bandwidth / ((config.num_hidden_layers * per_layer + 2 * config.vocab_size * h) * itemsize)
""",
        # Forgets the LM head.
        """
h, i = config.hidden_size, config.intermediate_size
per_layer = h * (config.q_size + 2 * config.kv_size) + config.q_size * h + 3 * h * i
return bandwidth / (config.num_hidden_layers * per_layer * itemsize)
""",
        # K and V projections as wide as Q: grouped-query attention forgotten.
        """
h, i = config.hidden_size, config.intermediate_size
per_layer = h * 3 * config.q_size + config.q_size * h + 3 * h * i
return bandwidth / ((config.num_hidden_layers * per_layer + config.vocab_size * h) * itemsize)
""",
        # The package's roofline: the exercise asks for the weights counted by hand.
        "return 1 / Roofline(bandwidth, math.inf).step_floor_seconds(config, 1, 1, 0, itemsize)",
    ],
    "tokens-per-step-solution": [
        # The closed form alone: at acceptance 1 it divides by zero.
        "return (1 - acceptance ** (k + 1)) / (1 - acceptance)",
        # Forgets the target's own token after the kept guesses.
        "return sum(acceptance**i for i in range(1, k + 1))",
        # Every guess counted on its own, as if a disagreement did not end the step.
        "return 1 + k * acceptance",
        # A simulation with the package's accepted_prefix: the exercise asks for the expectation.
        """
rng = random.Random(0)
total = 0
for _ in range(20_000):
    target = [rng.randrange(100) for _ in range(k + 1)]
    guesses = [t if rng.random() < acceptance else t + 100 for t in target[:k]]
    total += len(accepted_prefix(target, guesses))
return total / 20_000
""",
    ],
}
