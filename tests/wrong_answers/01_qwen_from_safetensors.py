"""Chapter 01's exercises answered wrongly, as a student plausibly would (see scripts/wrong_answers.py)."""

WRONG_ANSWERS = {
    "parse-header-solution": [
        # Checks only the header's length: a file cut inside the tensor data is accepted.
        """
if len(data) < 8:
    raise ValueError("too short for a safetensors header")
(header_len,) = struct.unpack("<Q", data[:8])
if 8 + header_len > len(data):
    raise ValueError(f"header of {header_len} bytes in a {len(data)}-byte file")
header = json.loads(data[8 : 8 + header_len])
header.pop("__metadata__", None)
return {n: (e["dtype"], tuple(e["shape"]), tuple(e["data_offsets"])) for n, e in header.items()}
""",
        # Offsets counted from the start of the file instead of as the header states them.
        """
if len(data) < 8:
    raise ValueError("too short for a safetensors header")
(header_len,) = struct.unpack("<Q", data[:8])
if 8 + header_len > len(data):
    raise ValueError(f"header of {header_len} bytes in a {len(data)}-byte file")
header = json.loads(data[8 : 8 + header_len])
header.pop("__metadata__", None)
result = {}
for name, entry in header.items():
    start, end = (8 + header_len + offset for offset in entry["data_offsets"])
    if end > len(data):
        raise ValueError(f"{name} ends at byte {end}, after the end of the data")
    result[name] = (entry["dtype"], tuple(entry["shape"]), (start, end))
return result
""",
        # Reads the header length as a big-endian number (safetensors is little-endian).
        """
if len(data) < 8:
    raise ValueError("too short for a safetensors header")
(header_len,) = struct.unpack(">Q", data[:8])
if 8 + header_len > len(data):
    raise ValueError(f"header of {header_len} bytes in a {len(data)}-byte file")
header = json.loads(data[8 : 8 + header_len])
header.pop("__metadata__", None)
result = {}
for name, entry in header.items():
    start, end = entry["data_offsets"]
    if 8 + header_len + end > len(data):
        raise ValueError(f"{name} ends after the end of the data")
    result[name] = (entry["dtype"], tuple(entry["shape"]), (start, end))
return result
""",
        # Compares the data's end with the file's length without the 8 + N bytes before the data.
        """
if len(data) < 8:
    raise ValueError("too short for a safetensors header")
(header_len,) = struct.unpack("<Q", data[:8])
if 8 + header_len > len(data):
    raise ValueError(f"header of {header_len} bytes in a {len(data)}-byte file")
header = json.loads(data[8 : 8 + header_len])
header.pop("__metadata__", None)
result = {}
for name, entry in header.items():
    start, end = entry["data_offsets"]
    if end > len(data):
        raise ValueError(f"{name} ends after the end of the data")
    result[name] = (entry["dtype"], tuple(entry["shape"]), (start, end))
return result
""",
    ],
    "count-params-solution": [
        # Forgets the q, k and v biases.
        """
h, i, v = raw["hidden_size"], raw["intermediate_size"], raw["vocab_size"]
heads = raw["num_attention_heads"]
kv_heads = raw.get("num_key_value_heads", heads)
head_dim = raw.get("head_dim") or h // heads
q, kv = heads * head_dim, kv_heads * head_dim
per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
head = 0 if raw.get("tie_word_embeddings", False) else v * h
return v * h + raw["num_hidden_layers"] * per_layer + h + head
""",
        # Counts the LM head even when it is tied to the embedding.
        """
h, i, v = raw["hidden_size"], raw["intermediate_size"], raw["vocab_size"]
heads = raw["num_attention_heads"]
kv_heads = raw.get("num_key_value_heads", heads)
head_dim = raw.get("head_dim") or h // heads
q, kv = heads * head_dim, kv_heads * head_dim
per_layer = h * (q + 2 * kv) + (q + 2 * kv) + q * h + 3 * h * i + 2 * h
return v * h + raw["num_hidden_layers"] * per_layer + h + v * h
""",
        # Derives head_dim from the hidden size even when the config states it.
        """
h, i, v = raw["hidden_size"], raw["intermediate_size"], raw["vocab_size"]
heads = raw["num_attention_heads"]
kv_heads = raw.get("num_key_value_heads", heads)
head_dim = h // heads
q, kv = heads * head_dim, kv_heads * head_dim
per_layer = h * (q + 2 * kv) + (q + 2 * kv) + q * h + 3 * h * i + 2 * h
head = 0 if raw.get("tie_word_embeddings", False) else v * h
return v * h + raw["num_hidden_layers"] * per_layer + h + head
""",
        # Calls the package's own count instead of working from the shapes.
        "return ModelConfig.from_dict(raw).num_params",
    ],
    "fused-slice-solution": [
        # Swaps k and v in the fused order ([q | v | k] instead of [q | k | v]).
        """
parts = name.split(".")
layer, leaf, kind = int(parts[2]), parts[4], parts[5]
if leaf in ("q_proj", "k_proj", "v_proj"):
    start = {"q_proj": 0, "v_proj": config.q_size, "k_proj": config.q_size + config.kv_size}[leaf]
    size = config.q_size if leaf == "q_proj" else config.kv_size
    return layer, "qkv_weight" if kind == "weight" else "qkv_bias", start, start + size
i = config.intermediate_size
return (layer, "gate_up_weight", 0, i) if leaf == "gate_proj" else (layer, "gate_up_weight", i, 2 * i)
""",
        # Gives q the size of k and v (forgets that grouped-query attention has fewer KV heads).
        """
parts = name.split(".")
layer, leaf, kind = int(parts[2]), parts[4], parts[5]
if leaf in ("q_proj", "k_proj", "v_proj"):
    index = ["q_proj", "k_proj", "v_proj"].index(leaf)
    start = index * config.kv_size
    return layer, "qkv_weight" if kind == "weight" else "qkv_bias", start, start + config.kv_size
i = config.intermediate_size
return (layer, "gate_up_weight", 0, i) if leaf == "gate_proj" else (layer, "gate_up_weight", i, 2 * i)
""",
        # Sends biases to the fused weight too (ignores the .weight/.bias suffix).
        """
parts = name.split(".")
layer, leaf = int(parts[2]), parts[4]
if leaf in ("q_proj", "k_proj", "v_proj"):
    start = {"q_proj": 0, "k_proj": config.q_size, "v_proj": config.q_size + config.kv_size}[leaf]
    size = config.q_size if leaf == "q_proj" else config.kv_size
    return layer, "qkv_weight", start, start + size
i = config.intermediate_size
return (layer, "gate_up_weight", 0, i) if leaf == "gate_proj" else (layer, "gate_up_weight", i, 2 * i)
""",
        # Asks the package's own map (Qwen2Model._destination) and reads the rows off the view.
        """
model = Qwen2Model(config)
view = model._destination(name)
layer = int(name.split(".")[2])
for parameter in ("qkv_weight", "qkv_bias", "gate_up_weight"):
    fused = getattr(model.layers[layer], parameter)
    if view.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr():
        start = (view.data_ptr() - fused.data_ptr()) // (fused.stride(0) * fused.element_size())
        return layer, parameter, start, start + view.shape[0]
raise ValueError(name)
""",
    ],
}
