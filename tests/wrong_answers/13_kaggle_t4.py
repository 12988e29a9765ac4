"""Chapter 13's exercises answered wrongly, as a student plausibly would (see scripts/wrong_answers.py)."""

# The input checks every right answer of 13.1 needs; the wrong answers differ after them.
_CARD_CHECKS = """
if not 0 < utilization <= 1:
    raise ValueError(f"utilization must be in (0, 1], got {utilization}")
if max_num_seqs < 1 or max_model_len < 1:
    raise ValueError(f"max_num_seqs and max_model_len must be at least 1, got {max_num_seqs} and {max_model_len}")
"""

WRONG_ANSWERS = {
    "smallest-card-solution": [
        # Forgets the headroom: the card only has to hold the weights, the context, the activations and the pool.
        _CARD_CHECKS
        + """
per_block = sum(2 * c.num_hidden_layers * c.num_key_value_heads * block_size * c.head_dim * itemsize for c in configs)
pool = max_num_seqs * -(-max_model_len // block_size) * per_block
held = sum(c.num_params for c in configs) * itemsize + context_bytes
return math.ceil((pool + held + activation_bytes) / MiB)
""",
        # Only the first model's KV: the draft's share of every block is forgotten.
        _CARD_CHECKS
        + """
c = configs[0]
per_block = 2 * c.num_hidden_layers * c.num_key_value_heads * block_size * c.head_dim * itemsize
pool = max_num_seqs * -(-max_model_len // block_size) * per_block
held = sum(c.num_params for c in configs) * itemsize + context_bytes
return math.ceil((pool + held + activation_bytes) / utilization / MiB)
""",
        # Tokens instead of blocks: a sequence's partly filled last block is not paid for.
        _CARD_CHECKS
        + """
per_token = sum(2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * itemsize for c in configs)
pool = max_num_seqs * max_model_len * per_token
held = sum(c.num_params for c in configs) * itemsize + context_bytes
return math.ceil((pool + held + activation_bytes) / utilization / MiB)
""",
        # Rounds down to whole MiB: the card it returns is a few bytes short.
        _CARD_CHECKS
        + """
per_block = sum(2 * c.num_hidden_layers * c.num_key_value_heads * block_size * c.head_dim * itemsize for c in configs)
pool = max_num_seqs * -(-max_model_len // block_size) * per_block
held = sum(c.num_params for c in configs) * itemsize + context_bytes
return int((pool + held + activation_bytes) / utilization / MiB)
""",
        # The package's sizing, searched for the card: the exercise asks for the arithmetic itself.
        _CARD_CHECKS
        + """
weights = sum(c.num_params for c in configs) * itemsize
dtype = {2: torch.float16, 4: torch.float32}[itemsize]
card = 1
while True:
    with mock.patch("torch.cuda.mem_get_info", return_value=(card * MiB - weights - context_bytes, card * MiB)):
        try:
            blocks = kv_blocks_for_memory(configs, block_size=block_size, dtype=dtype, device=torch.device("cuda"),
                                          max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                          gpu_memory_utilization=utilization, activation_bytes=activation_bytes)
        except MemoryError:
            blocks = 0
    if blocks == max_num_seqs * -(-max_model_len // block_size):
        return card
    card += 1
""",
        # No input checks: a utilization of 0 divides by zero instead of naming the argument.
        """
per_block = sum(2 * c.num_hidden_layers * c.num_key_value_heads * block_size * c.head_dim * itemsize for c in configs)
pool = max_num_seqs * -(-max_model_len // block_size) * per_block
held = sum(c.num_params for c in configs) * itemsize + context_bytes

def enough(mib):
    return int(utilization * (mib * MiB) - held - activation_bytes) >= pool

card = math.ceil((pool + held + activation_bytes) / utilization / MiB)
while not enough(card):
    card += 1
while enough(card - 1):
    card -= 1
return card
""",
    ],
    "conversation-hits-solution": [
        # Forgets that the last prompt token is always computed: a prompt asked again is served whole.
        """
cached, hits = [], []
for prompt, output in turns:
    best = 0
    for tokens in cached:
        n = 0
        while n < min(len(prompt), len(tokens)) and prompt[n] == tokens[n]:
            n += 1
        best = max(best, n // block_size * block_size)
    hits.append(best)
    cached.append(list(prompt) + list(output[:-1]))
return hits
""",
        # Caches the whole exchange: the last output token's K/V was never computed.
        """
cached, hits = [], []
for prompt, output in turns:
    query = prompt[:-1]
    best = 0
    for tokens in cached:
        n = 0
        while n < min(len(query), len(tokens)) and query[n] == tokens[n]:
            n += 1
        best = max(best, n // block_size * block_size)
    hits.append(best)
    cached.append(list(prompt) + list(output))
return hits
""",
        # Only prompts are cached, as if the answers' K/V were thrown away.
        """
cached, hits = [], []
for prompt, output in turns:
    query = prompt[:-1]
    best = 0
    for tokens in cached:
        n = 0
        while n < min(len(query), len(tokens)) and query[n] == tokens[n]:
            n += 1
        best = max(best, n // block_size * block_size)
    hits.append(best)
    cached.append(list(prompt))
return hits
""",
        # Compares with the previous turn only: an edited or repeated question finds nothing older.
        """
previous, hits = None, []
for prompt, output in turns:
    query = prompt[:-1]
    best = 0
    if previous is not None:
        n = 0
        while n < min(len(query), len(previous)) and query[n] == previous[n]:
            n += 1
        best = n // block_size * block_size
    hits.append(best)
    previous = list(prompt) + list(output[:-1])
return hits
""",
        # Every matching token counts, not whole blocks.
        """
cached, hits = [], []
for prompt, output in turns:
    query = prompt[:-1]
    best = 0
    for tokens in cached:
        n = 0
        while n < min(len(query), len(tokens)) and query[n] == tokens[n]:
            n += 1
        best = max(best, n)
    hits.append(best)
    cached.append(list(prompt) + list(output[:-1]))
return hits
""",
        # Chapter 8's RadixCache replayed: the exercise asks for the rule, not the tree.
        """
from mini_infer.kv.block_pool import BlockPool

pool = BlockPool(4096, block_size)
tree, hits = RadixCache(pool), []
for prompt, output in turns:
    hits.append(tree.match_prefix(prompt[:-1]).num_tokens)
    computed = (list(prompt) + list(output))[:-1]
    full = len(computed) // block_size
    blocks = pool.allocate(full)
    tree.insert(computed[: full * block_size], blocks)
    pool.free(blocks)
return hits
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
    "break-even-solution": [
        # c from the parameter counts: the embedding table and the norms counted as if a pass read them.
        """
if k < 1:
    raise ValueError(f"k must be at least 1 guess a step, got {k}")
cost = draft.num_params / target.num_params
if cost > 1:
    return None
low, high = 0.0, 1.0
for _ in range(100):
    middle = (low + high) / 2
    if sum(middle**i for i in range(k + 1)) < 1 + k * cost:
        low = middle
    else:
        high = middle
return high
""",
        # One draft pass per verified row: k + 1 passes a step instead of k.
        """
if k < 1:
    raise ValueError(f"k must be at least 1 guess a step, got {k}")

def bytes_read(c):
    h, i = c.hidden_size, c.intermediate_size
    return c.num_hidden_layers * (h * (c.q_size + 2 * c.kv_size) + c.q_size * h + 3 * h * i) + c.vocab_size * h

cost = bytes_read(draft) / bytes_read(target)
if cost > 1:
    return None
low, high = 0.0, 1.0
for _ in range(100):
    middle = (low + high) / 2
    if sum(middle**i for i in range(k + 1)) < 1 + (k + 1) * cost:
        low = middle
    else:
        high = middle
return high
""",
        # The break-even of k = 1 for every k: a further guess is taken to pay at the same rate.
        """
if k < 1:
    raise ValueError(f"k must be at least 1 guess a step, got {k}")

def bytes_read(c):
    h, i = c.hidden_size, c.intermediate_size
    return c.num_hidden_layers * (h * (c.q_size + 2 * c.kv_size) + c.q_size * h + 3 * h * i) + c.vocab_size * h

cost = bytes_read(draft) / bytes_read(target)
return None if cost > 1 else cost
""",
        # The package's roofline for c: the exercise asks for the bytes counted by hand (or by exercise 13.3).
        """
if k < 1:
    raise ValueError(f"k must be at least 1 guess a step, got {k}")
cost = weight_bytes_read(draft, 2) / weight_bytes_read(target, 2)
if cost > 1:
    return None
low, high = 0.0, 1.0
for _ in range(100):
    middle = (low + high) / 2
    if sum(middle**i for i in range(k + 1)) < 1 + k * cost:
        low = middle
    else:
        high = middle
return high
""",
        # Never None: a draft larger than the target is clamped to a rate of 1 instead.
        """
if k < 1:
    raise ValueError(f"k must be at least 1 guess a step, got {k}")

def bytes_read(c):
    h, i = c.hidden_size, c.intermediate_size
    return c.num_hidden_layers * (h * (c.q_size + 2 * c.kv_size) + c.q_size * h + 3 * h * i) + c.vocab_size * h

cost = bytes_read(draft) / bytes_read(target)
low, high = 0.0, 1.0
for _ in range(100):
    middle = (low + high) / 2
    if sum(middle**i for i in range(k + 1)) < 1 + k * cost:
        low = middle
    else:
        high = middle
return high
""",
        # The target's own token forgotten: a step is taken to yield only the kept guesses.
        """
if k < 1:
    raise ValueError(f"k must be at least 1 guess a step, got {k}")

def bytes_read(c):
    h, i = c.hidden_size, c.intermediate_size
    return c.num_hidden_layers * (h * (c.q_size + 2 * c.kv_size) + c.q_size * h + 3 * h * i) + c.vocab_size * h

cost = bytes_read(draft) / bytes_read(target)
if cost > 1:
    return None
low, high = 0.0, 1.0
for _ in range(100):
    middle = (low + high) / 2
    if sum(middle**i for i in range(1, k + 1)) < 1 + k * cost:
        low = middle
    else:
        high = middle
return high
""",
    ],
}
