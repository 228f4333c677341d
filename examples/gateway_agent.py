"""An agent trained through the gateway that never imports areal-grpc: only ``openai``,
``httpx`` and the standard library.

The task is a two-turn exchange with a checking tool. The agent asks the model to echo a
character (``"k="`` -> ``"k"``); a checker tool looks at the reply and its verdict goes back to
the model as a ``tool`` message with the question again; the model answers a second time. The
reward is the second answer's: 1 when it starts with the character, 0.1 when it starts with
another character of the alphabet, else 0. Each episode is one RL session: ``--n`` replies to
the same question (8), each continued in its own conversation, rewarded per completion. The
run trains on these sessions alone (``data.task=external``):

    .venv/bin/python -m areal_grpc.coordinator data.task=external eval.every_steps=0 \\
        gateway.enabled=true total_steps=400 staleness.batch_size=16 trainer.lr=1e-3
    .venv/bin/python examples/gateway_agent.py --gateway http://127.0.0.1:<port>

(it runs until the run ends and its gateway goes away, or ``--episodes``).

It prints the mean reward of every 32 episodes and, with ``--log``, writes one JSON line per
episode (time, reward, policy version) for plotting.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import string
import time

import httpx
import openai

CHARS = string.digits + string.ascii_lowercase


async def open_session(http: httpx.AsyncClient, group_size: int) -> str:
    """An RL session, waiting out 429s (the staleness budget is full until a step trains)."""
    while True:
        r = await http.post("/rl/sessions", json={"group_size": group_size})
        if r.status_code != 429:
            r.raise_for_status()
            return str(r.json()["session_id"])
        await asyncio.sleep(float(r.headers.get("Retry-After", "1")))


def check(reply: str, char: str) -> bool:
    """The tool: does the reply start with the character?"""
    return reply.startswith(char)


def score(reply: str, char: str) -> float:
    """1 for the right character; 0.1 for another of the question's alphabet (a format
    reward: a fresh model puts almost all its mass elsewhere in its 384 byte tokens)."""
    if check(reply, char):
        return 1.0
    return 0.1 if reply[:1] and reply[0] in CHARS else 0.0


async def episode(http: httpx.AsyncClient, base_url: str, rng: random.Random, n: int) -> dict:
    """One session: the question, ``n`` first answers, the tool's verdicts, ``n`` second ones."""
    char = rng.choice(CHARS)
    sid = await open_session(http, n)
    client = openai.AsyncOpenAI(
        base_url=f"{base_url}/v1",
        api_key="unused",
        max_retries=2,
        default_headers={"X-Session-Id": sid},
    )
    question = {"role": "user", "content": f"{char}="}
    first = await client.chat.completions.create(
        model="policy", messages=[question], n=n, max_tokens=2, temperature=1.0
    )

    async def second_turn(choice: object) -> tuple[str, float, str]:
        reply = choice.message.content or ""  # type: ignore[attr-defined]
        verdict = "correct" if check(reply, char) else "wrong"
        messages = [
            question,
            {"role": "assistant", "content": reply},
            {"role": "tool", "content": f"checker: {verdict}"},
            question,
        ]
        again = await client.chat.completions.create(
            model="policy", messages=messages, max_tokens=2, temperature=1.0
        )
        final = again.choices[0].message.content or ""
        cid: str = again.choices[0].completion_id  # type: ignore[attr-defined]
        return cid, score(final, char), again.system_fingerprint or ""

    results = await asyncio.gather(*(second_turn(c) for c in first.choices))
    await client.close()
    rewards = {cid: r for cid, r, _ in results}
    reply = await http.post(f"/rl/sessions/{sid}/reward", json={"rewards": rewards})
    reply.raise_for_status()
    return {
        "t": time.time(),
        "reward": sum(rewards.values()) / len(rewards),
        "policy": results[0][2],
        "accepted": reply.json()["accepted"],
    }


async def main_async(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    log = open(args.log, "w") if args.log else None  # noqa: SIM115
    done: list[dict] = []
    start = time.time()
    async with httpx.AsyncClient(base_url=args.gateway, timeout=120) as http:

        async def worker() -> None:
            while len(done) < args.episodes:
                try:
                    record = await episode(http, args.gateway, rng, args.n)
                except (httpx.ConnectError, openai.APIConnectionError):
                    print("the gateway is gone (the run ended): stopping", flush=True)
                    return
                record["t"] -= start
                done.append(record)
                if log is not None:
                    log.write(json.dumps(record) + "\n")
                    log.flush()
                if len(done) % 32 == 0:
                    window = done[-32:]
                    mean = sum(r["reward"] for r in window) / len(window)
                    print(
                        f"{len(done):>5} episodes, {record['t']:6.0f} s: mean reward of the "
                        f"last 32 {mean:.3f} ({record['policy']})",
                        flush=True,
                    )

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    if log is not None:
        log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gateway", required=True, help="http://host:port (the GATEWAY line)")
    parser.add_argument("--episodes", type=int, default=1_000_000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--n", type=int, default=8, help="replies per question (the group)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", help="write one JSON line per episode here")
    parser.add_argument("--plot", help="with --log: draw the reward curve into this PNG")
    args = parser.parse_args()
    args.gateway = args.gateway.removesuffix("/").removesuffix("/v1")
    asyncio.run(main_async(args))
    if args.plot and args.log:
        plot(args.log, args.plot)


def plot(log: str, png: str, window: int = 64) -> None:
    """Mean reward of the last ``window`` episodes against seconds (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(log) as f:
        records = [json.loads(line) for line in f]
    xs, ys = [], []
    for i in range(window, len(records) + 1, window // 4):
        part = records[i - window : i]
        xs.append(part[-1]["t"])
        ys.append(sum(r["reward"] for r in part) / window)
    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=100)
    ax.plot(xs, ys)
    ax.set_xlabel("seconds")
    ax.set_ylabel(f"mean reward, last {window} episodes")
    ax.set_title("an openai-package agent trained through areal-gateway")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png)


if __name__ == "__main__":
    main()
