"""An agent with a calculator tool, trained through the gateway, that never imports
areal-grpc: only ``openai``, ``httpx`` and the standard library.

The task: "What is 347 + 589?" (two 3-digit numbers; SmolLM2-135M-Instruct almost never adds
them right on its own). The agent offers the model one function tool, ``calculator``, through
the chat-completions ``tools`` field, with one worked example in the conversation (a question,
the assistant's call, the tool's result, the answer). When a reply calls the tool, the agent
evaluates the expression and sends the result back as a ``tool`` message (up to
``--tool-rounds`` times); the model's next reply is its answer. Reward: 1 when the answer's
last number is the sum, else 0. So the reward rises as the model learns to call the tool,
with the right numbers, and to copy its result. Each question is one RL session: ``--n``
replies (8), each continued in its own conversation, rewarded per completion. The run trains
on these sessions alone (``data.task=external``):

    .venv/bin/python -m areal_grpc.coordinator --config examples/smollm2_agent.yaml
    .venv/bin/python examples/gateway_agent.py --gateway http://127.0.0.1:<port>

(it runs until the run ends and its gateway goes away, or ``--episodes``).

It prints the mean reward and the share of replies that called the tool for every 16
episodes and, with ``--log``, writes one JSON line per episode for plotting (``--plot``).
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import operator
import random
import re
import time
from typing import Any

import httpx
import openai

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates an arithmetic expression",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
SYSTEM = "Use the calculator, then answer with just the number."


def worked_example() -> list[dict[str, Any]]:
    """One question answered with the tool, as the conversation's first turns."""
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "calculator", "arguments": json.dumps({"expression": "12 + 30"})},
    }
    return [
        {"role": "user", "content": "What is 12 + 30?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": "42"},
        {"role": "assistant", "content": "42"},
    ]


OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def calculate(expression: str) -> str:
    """The tool: + - * / over numbers and parentheses (no names, no calls), or an error."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError("only numbers and + - * / are allowed")

    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as exc:
        return f"error: {exc}"
    return str(int(result)) if float(result).is_integer() else str(result)


def run_tool(call: Any) -> str:
    """What one tool call returns (an error message for anything but a good calculator call)."""
    if call.function.name != "calculator":
        return f"error: no tool named {call.function.name!r}"
    try:
        args = json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError:
        return "error: arguments are not JSON"
    expression = args.get("expression") if isinstance(args, dict) else None
    if not isinstance(expression, str):
        return "error: give the expression as a string"
    return calculate(expression)


def score(answer: str, total: int) -> float:
    """1 when the answer's last number is the sum."""
    numbers = re.findall(r"-?\d+", answer.replace(",", ""))
    return 1.0 if numbers and int(numbers[-1]) == total else 0.0


async def open_session(http: httpx.AsyncClient, group_size: int) -> str:
    """An RL session, waiting out 429s (the staleness budget is full until a step trains)."""
    while True:
        r = await http.post("/rl/sessions", json={"group_size": group_size})
        if r.status_code != 429:
            r.raise_for_status()
            return str(r.json()["session_id"])
        await asyncio.sleep(float(r.headers.get("Retry-After", "1")))


async def episode(
    http: httpx.AsyncClient, base_url: str, rng: random.Random, args: argparse.Namespace
) -> dict[str, Any]:
    """One session: a question, ``n`` replies, each carried through its tool calls."""
    a, b = rng.randrange(100, 1000), rng.randrange(100, 1000)
    sid = await open_session(http, args.n)
    client = openai.AsyncOpenAI(
        base_url=f"{base_url}/v1",
        api_key="unused",
        max_retries=2,
        default_headers={"X-Session-Id": sid},
    )
    messages: list[Any] = [
        {"role": "system", "content": SYSTEM},
        *worked_example(),
        {"role": "user", "content": f"What is {a} + {b}?"},
    ]
    first = await client.chat.completions.create(
        model="policy",
        messages=messages,
        tools=[CALCULATOR],  # type: ignore[list-item]
        n=args.n,
        max_tokens=48,
        temperature=1.0,
    )

    async def carry_on(choice: Any) -> tuple[str, float, bool, str]:
        """Runs the reply's tool calls until it answers; (completion id, reward, called, policy)."""
        history, called = list(messages), False
        reply, cid, policy = choice.message, choice.completion_id, first.system_fingerprint
        for _ in range(args.tool_rounds):
            if not reply.tool_calls:
                break
            called = True
            # Sent back as the openai package parsed it: the gateway continues the
            # conversation from the ids it sampled, not from a re-rendering of the call.
            history.append(reply.model_dump(exclude_none=True))
            history += [
                {"role": "tool", "tool_call_id": c.id, "content": run_tool(c)}
                for c in reply.tool_calls
            ]
            again = await client.chat.completions.create(
                model="policy",
                messages=history,
                tools=[CALCULATOR],  # type: ignore[list-item]
                max_tokens=16,
                temperature=1.0,
            )
            reply, cid, policy = (
                again.choices[0].message,
                again.choices[0].completion_id,  # type: ignore[attr-defined]
                again.system_fingerprint,
            )
        return cid, score(reply.content or "", a + b), called, policy or ""

    results = await asyncio.gather(*(carry_on(c) for c in first.choices))
    await client.close()
    rewards = {cid: r for cid, r, _, _ in results}
    reply = await http.post(f"/rl/sessions/{sid}/reward", json={"rewards": rewards})
    reply.raise_for_status()
    return {
        "t": time.time(),
        "reward": sum(rewards.values()) / len(rewards),
        "tool_rate": sum(c for _, _, c, _ in results) / len(results),
        "policy": results[-1][3],
        "accepted": reply.json()["accepted"],
    }


async def main_async(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    log = open(args.log, "w") if args.log else None  # noqa: SIM115
    done: list[dict[str, Any]] = []
    start = time.time()
    async with httpx.AsyncClient(base_url=args.gateway, timeout=300) as http:

        async def worker() -> None:
            while len(done) < args.episodes:
                try:
                    record = await episode(http, args.gateway, rng, args)
                except (httpx.ConnectError, openai.APIConnectionError):
                    print("the gateway is gone (the run ended): stopping", flush=True)
                    return
                record["t"] -= start
                done.append(record)
                if log is not None:
                    log.write(json.dumps(record) + "\n")
                    log.flush()
                if len(done) % 16 == 0:
                    window = done[-16:]
                    reward = sum(r["reward"] for r in window) / len(window)
                    tools = sum(r["tool_rate"] for r in window) / len(window)
                    print(
                        f"{len(done):>5} episodes, {record['t']:6.0f} s: last 16 mean reward "
                        f"{reward:.3f}, replies calling the tool {tools:.2f} ({record['policy']})",
                        flush=True,
                    )

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    if log is not None:
        log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gateway", required=True, help="http://host:port (the GATEWAY line)")
    parser.add_argument("--episodes", type=int, default=1_000_000)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--n", type=int, default=8, help="replies per question (the group)")
    parser.add_argument("--tool-rounds", type=int, default=2, help="tool calls per reply, at most")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", help="write one JSON line per episode here")
    parser.add_argument("--plot", help="with --log: draw the curves into this PNG")
    args = parser.parse_args()
    args.gateway = args.gateway.removesuffix("/").removesuffix("/v1")
    asyncio.run(main_async(args))
    if args.plot and args.log:
        plot(args.log, args.plot)


def plot(log: str, png: str, window: int = 4) -> None:
    """Mean reward and tool-call share of the last ``window`` episodes against seconds
    (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(log) as f:
        records = [json.loads(line) for line in f]
    xs, reward, tools = [], [], []
    for i in range(window, len(records) + 1):
        part = records[i - window : i]
        xs.append(part[-1]["t"])
        reward.append(sum(r["reward"] for r in part) / window)
        tools.append(sum(r["tool_rate"] for r in part) / window)
    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=100)
    ax.plot(xs, reward, label="reward (answer right)")
    ax.plot(xs, tools, label="replies calling the tool", linestyle="--")
    ax.set_xlabel("seconds")
    ax.set_ylabel(f"mean of the last {window} episodes")
    ax.set_ylim(0, 1)
    ax.set_title("an openai-package agent with a calculator, trained through areal-gateway")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png)


if __name__ == "__main__":
    main()
