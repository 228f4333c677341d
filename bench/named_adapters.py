"""Named LoRA adapters on the hf engine: what decoding rows of different adapters in one batch
gains, and what it costs next to a batch of one policy.

K random adapters (rank ``--rank``, every linear layer) are loaded on one hf engine; each
adapter gets ``--per-adapter`` greedy requests (``--prompt`` tokens in, ``--tokens`` out).

1. ``named_adapters_batched_<K>``: every request at once (rows of all K adapters in one batch,
   peft's mixed-adapter forward) against the same requests one at a time.
   ``ratio = batched tokens/s / one-at-a-time tokens/s``; it also checks that both ways give
   the same tokens.
2. ``named_adapters_mixed_vs_one_<K>``: the same batch, against as many requests that all name
   one adapter (the same LoRA work, one sub-batch per layer instead of K).
   ``ratio = K adapters' tokens/s / one adapter's tokens/s`` (1.0: mixing costs nothing).
   Also printed: the same requests of the run's own policy on an engine without named
   adapters (no LoRA work at all).

    .venv/bin/python bench/named_adapters.py [--model builtin:tiny] [--adapters 4]
        [--per-adapter 2] [--rank 16] [--prompt 16] [--tokens 32] [--reps 3]

Medians over ``--reps`` alternating windows; one torch thread, as a rollout server runs.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch
from areal_servers.rollout.engine import SamplingConfig
from areal_servers.rollout.hf_engine import HFEngine
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from results import result

from areal_grpc.config import ModelConfig, RolloutConfig
from areal_grpc.model import load_model

LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def adapter(model: str, seed: int, rank: int) -> dict[str, torch.Tensor]:
    """A random adapter of every linear layer (peft's saved names)."""
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=LINEAR, init_lora_weights=False)
    peft_model = get_peft_model(load_model(model, seed=0), config)
    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(peft_model).items()}


async def timed(
    engine: HFEngine, jobs: list[tuple[list[int], str]], cfg: SamplingConfig, batched: bool
):
    """(tokens per second, the tokens of each job)."""
    start = time.perf_counter()
    if batched:
        outs = await asyncio.gather(*(engine.generate(p, cfg, a) for p, a in jobs))
    else:
        outs = [await engine.generate(p, cfg, a) for p, a in jobs]
    elapsed = time.perf_counter() - start
    return sum(len(o.output_ids) for o in outs) / elapsed, [o.output_ids for o in outs]


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--per-adapter", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    k = args.adapters
    model = ModelConfig(source=args.model, seed=0)
    rollout = RolloutConfig(device="cpu", max_adapters=k)
    engine = HFEngine(model, rollout)
    plain = HFEngine(model, rollout)
    vocab = engine.vocab_size
    for i in range(k):
        await engine.load_adapter(
            f"a{i}", adapter(args.model, i + 1, args.rank), args.rank, 2.0 * args.rank
        )
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, vocab, (args.prompt,), generator=gen).tolist()
        for _ in range(k * args.per_adapter)
    ]
    jobs = [(p, f"a{i % k}") for i, p in enumerate(prompts)]
    single = [(p, "a0") for p in prompts]
    own = [(p, "") for p in prompts]
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=args.tokens, ignore_eos=True)
    await timed(engine, jobs[:2], cfg, True)  # warm-up
    await timed(plain, own[:2], cfg, True)
    batched, alone, one_adapter, one_policy = [], [], [], []
    same = True
    for _ in range(args.reps):
        rate, tokens_batched = await timed(engine, jobs, cfg, True)
        batched.append(rate)
        rate, tokens_alone = await timed(engine, jobs, cfg, False)
        alone.append(rate)
        same = same and tokens_batched == tokens_alone
        one_adapter.append((await timed(engine, single, cfg, True))[0])
        one_policy.append((await timed(plain, own, cfg, True))[0])
    b, a, s1, o = (statistics.median(x) for x in (batched, alone, one_adapter, one_policy))
    print(
        f"{k} adapters batched {b:.1f} tok/s, one at a time {a:.1f}; one adapter batched "
        f"{s1:.1f}; the run's own policy (no named adapters) batched {o:.1f}"
    )
    print(f"same tokens batched and one at a time: {same}")
    result(f"named_adapters_batched_{k}", b, "tok/s", a, "none")
    result(f"named_adapters_mixed_vs_one_{k}", b, "tok/s", s1, "none")
    await engine.close()
    await plain.close()


if __name__ == "__main__":
    asyncio.run(main())
