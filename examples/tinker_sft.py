"""Supervised fine-tuning through the official ``tinker`` SDK, unchanged, against a
self-hosted ``python -m areal_grpc.tinker``. It imports nothing of this project.

    TINKER_BASE_URL=http://127.0.0.1:PORT TINKER_API_KEY=tml-... \\
        .venv/bin/python examples/tinker_sft.py [--steps 12]

Teaches SmolLM2-135M-Instruct one fact with a LoRA adapter, then samples the answer from the
saved sampler weights: the loss printed each step falls, and the last line is the reply.
"""

from __future__ import annotations

import argparse

import tinker
from tinker import types

BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
QUESTION = "What is the code name of the blue team's project?"
ANSWER = " The code name is Heliotrope."


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--lr", type=float, default=5e-4)
    args = p.parse_args()

    service = tinker.ServiceClient()  # TINKER_BASE_URL and TINKER_API_KEY from the environment
    training = service.create_lora_training_client(base_model=BASE_MODEL, rank=args.rank).result()
    tokenizer = training.get_tokenizer()
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=False
    )
    prompt = tokenizer.encode(text, add_special_tokens=False)
    answer = [*tokenizer.encode(ANSWER, add_special_tokens=False), tokenizer.eos_token_id]
    tokens = prompt + answer
    # Position i predicts token i + 1; only the answer's tokens are trained on.
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "weights": [0.0] * (len(prompt) - 1) + [1.0] * len(answer),
        },
    )
    for step in range(args.steps):
        backward = training.forward_backward([datum], "cross_entropy")
        optimize = training.optim_step(types.AdamParams(learning_rate=args.lr))
        loss = backward.result().metrics["loss:sum"] / len(answer)
        optimize.result()
        print(f"step {step}: loss per answer token {loss:.3f}", flush=True)

    sampler = training.save_weights_and_get_sampling_client().result()
    reply = sampler.sample(
        prompt=types.ModelInput.from_ints(prompt),
        num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=24, temperature=0.0),
    ).result()
    print("reply:", tokenizer.decode(reply.sequences[0].tokens, skip_special_tokens=True))


if __name__ == "__main__":
    main()
