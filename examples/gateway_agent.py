"""An agent trained through the gateway that never imports areal-grpc: only ``openai``,
``httpx`` and the standard library.

The task is a two-turn exchange with a checking tool. The agent asks the model to echo a
character (``"k="`` -> ``"k"``); a checker tool looks at the reply and its verdict goes back to
the model as a ``tool`` message with the question again; the model answers a second time. The
reward is 1 when the second answer starts with the character, 0.5 when only the first did, else
0. Each episode is one RL session: four replies to the same question (``n=4``), each continued
in its own conversation, rewarded per completion. The run trains on these sessions alone
(``data.task=external``):

    .venv/bin/python -m areal_grpc.coordinator data.task=external eval.every_steps=0 \\
        gateway.enabled=true total_steps=60 staleness.batch_size=8 trainer.lr=1e-3 \\
        rollout.sampling.max_new_tokens=2
    .venv/bin/python examples/gateway_agent.py --gateway http://127.0.0.1:<port> --episodes 640

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
    return reply.strip().startswith(char)


async def episode(http: httpx.AsyncClient, base_url: str, rng: random.Random) -> dict:
    """One session: the question, four first answers, the tool's verdicts, four second ones."""
    char = rng.choice(CHARS)
    sid = await open_session(http, 4)
    client = openai.AsyncOpenAI(
        base_url=f"{base_url}/v1",
        api_key="unused",
        max_retries=2,
        default_headers={"X-Session-Id": sid},
    )
    question = {"role": "user", "content": f"{char}="}
    first = await client.chat.completions.create(
        model="policy", messages=[question], n=4, max_tokens=2, temperature=1.0
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
        reward = 1.0 if check(final, char) else (0.5 if verdict == "correct" else 0.0)
        return again.choices[0].completion_id, reward, again.system_fingerprint or ""  # type: ignore[attr-defined]

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
                record = await episode(http, args.gateway, rng)
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
    parser.add_argument("--episodes", type=int, default=640)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", help="write one JSON line per episode here")
    args = parser.parse_args()
    args.gateway = args.gateway.removesuffix("/").removesuffix("/v1")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
