"""What chapter 02's float16 policy costs: the o and down projections on scaled inputs (chapter 02).

    python scripts/fp16_policy_cost.py [--layers 4] [--repeats 7] [--device cpu]

Builds a Qwen2.5-0.5B-shaped model (random weights, ``--layers`` of its 24 layers) in float16 and
times its forward pass, for a decode step (one token per sequence, ``--batch`` sequences) and a
prefill chunk (``--chunk`` tokens), with the policy (``projection_scale`` = 2**-6: each o and down
projection's input multiplied by it, the residual adding the output times 64) and without it
(scale 1, a plain sum), alternating the two within each round so that both see the same machine.
Prints the median time of each and their ratio. A speed figure, never a test.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

from mini_infer.config import ModelConfig
from mini_infer.device import synchronize
from mini_infer.layers import projection_scale
from mini_infer.model import FullAttention, Qwen2Model
from mini_infer.offline_models import NAMED_SHAPES, qwen2_config_dict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=16, help="sequences of the decode step")
    parser.add_argument("--chunk", type=int, default=256, help="tokens of the prefill chunk")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    shape = replace(NAMED_SHAPES["qwen2.5-0.5b"], num_hidden_layers=args.layers)
    config = ModelConfig.from_dict(qwen2_config_dict(shape, torch_dtype="float16", eos_token_ids=[0]))
    torch.manual_seed(0)
    model = Qwen2Model(config, torch.float16, device)
    for param in model.parameters():
        param.normal_(0, 0.02)
    for layer in model.layers:
        layer.input_norm.fill_(1.0)
        layer.post_attn_norm.fill_(1.0)
    model.norm.fill_(1.0)

    class Decode:  # every token attends only to itself: the projections dominate, as at decode
        def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)

    cases = {
        f"decode, {args.batch} sequences": (args.batch, Decode()),
        f"prefill, {args.chunk} tokens": (args.chunk, FullAttention()),
    }
    policy = projection_scale(torch.float16)
    print(f"{config.num_hidden_layers} layers of Qwen2.5-0.5B's shape, float16, on {device}; median of {args.repeats}")
    for name, (tokens, attn) in cases.items():
        ids = torch.randint(0, config.vocab_size, (tokens,), device=device)
        positions = torch.arange(tokens, device=device)
        times: dict[float, list[float]] = {policy: [], 1.0: []}
        with torch.inference_mode():
            for _ in range(args.repeats + 1):  # the first round warms up and is dropped
                for scale in times:
                    model.projection_scale = scale
                    synchronize(device)
                    start = time.perf_counter()
                    model.forward(ids, positions, attn)
                    synchronize(device)
                    times[scale].append(time.perf_counter() - start)
        with_policy, without = (statistics.median(times[s][1:]) for s in (policy, 1.0))
        print(
            f"{name}: scaled projections {with_policy * 1e3:.2f} ms, plain {without * 1e3:.2f} ms, "
            f"ratio {with_policy / without:.3f}"
        )


if __name__ == "__main__":
    main()
