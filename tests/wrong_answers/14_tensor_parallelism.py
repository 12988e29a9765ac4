"""Chapter 14's exercises answered wrongly, as a student plausibly would (see scripts/wrong_answers.py)."""

WRONG_ANSWERS = {
    "vocab-lookup-solution": [
        # Clamps the ids into the shard but never zeros the rows of ids held elsewhere.
        """
rows = shard.shape[0]
local = (ids - rank * rows).clamp(0, rows - 1)
return shard[local]
""",
        # Off by one at the upper end: the first id of the next rank counts as this rank's.
        """
rows = shard.shape[0]
local = ids - rank * rows
elsewhere = (local < 0) | (local > rows)
found = shard[local.masked_fill(elsewhere, 0)]
return found.masked_fill(elsewhere[:, None], 0)
""",
        # Row `id % rows`: every rank answers for every id.
        "return shard[ids % shard.shape[0]]",
        # The package's shard_range for the held ids: the exercise asks for the offsets themselves.
        """
from mini_infer.parallel.shards import shard_range

held = shard_range(shard.shape[0] * (rank + 1), rank, rank + 1)
mine = (ids >= held.start) & (ids < held.stop)
out = torch.zeros(len(ids), shard.shape[1], dtype=shard.dtype)
out[mine] = shard[ids[mine] - held.start]
return out
""",
    ],
    "collective-bytes-solution": [
        # One all-reduce per layer instead of two (attention and MLP each end with one).
        """
all_reduces = (1 + config.num_hidden_layers) * num_tokens * config.hidden_size
all_gather = num_logits * -(-config.vocab_size // size)
return (all_reduces + all_gather) * itemsize
""",
        # Forgets the embedding's all-reduce.
        """
all_reduces = 2 * config.num_hidden_layers * num_tokens * config.hidden_size
all_gather = num_logits * -(-config.vocab_size // size)
return (all_reduces + all_gather) * itemsize
""",
        # Floor division: a vocabulary that the ranks do not divide loses the padded columns.
        """
all_reduces = (1 + 2 * config.num_hidden_layers) * num_tokens * config.hidden_size
all_gather = num_logits * (config.vocab_size // size)
return (all_reduces + all_gather) * itemsize
""",
        # Each rank sends the whole vocabulary's logits, not its shard.
        """
all_reduces = (1 + 2 * config.num_hidden_layers) * num_tokens * config.hidden_size
all_gather = num_logits * config.vocab_size
return (all_reduces + all_gather) * itemsize
""",
    ],
    "tp-sizes-solution": [
        # Only the attention heads are checked.
        "return [n for n in range(1, max_size + 1) if config.num_attention_heads % n == 0]",
        # The MLP's width forgotten: heads and KV heads only.
        """
split = (config.num_attention_heads, config.num_key_value_heads)
return [n for n in range(1, max_size + 1) if all(value % n == 0 for value in split)]
""",
        # Off by one: max_size itself is never tried.
        """
split = (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size)
return [n for n in range(1, max_size) if all(value % n == 0 for value in split)]
""",
        # Asks shard_config which sizes it accepts: the exercise asks for the rule itself.
        """
sizes = []
for n in range(1, max_size + 1):
    try:
        shard_config(config, n)
        sizes.append(n)
    except ValueError:
        pass
return sizes
""",
    ],
}
