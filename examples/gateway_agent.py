"""An agent with a calculator tool, trained through the gateway, that never imports
areal-grpc: only ``openai``, ``httpx`` and the standard library.

The task: "What is 347 + 589?" (two 3-digit numbers; SmolLM2-135M-Instruct almost never adds
them right on its own). The agent offers the model one function tool, ``calculator``, through
the chat-completions ``tools`` field, with three worked examples in the conversation (each a
question, the assistant's call, the tool's result, the answer; ``--worked``). Measured on the
untrained model: with one worked example (12 + 30) 9% of its replies called the tool and 2%
answered right, so most groups of 8 replies had no reward to learn from; with three (two of
them 3-digit sums, like the task) 58% called it and 33% answered right. When a reply calls
the tool, the agent
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
episodes and, with ``--log``, writes one JSON line per episode for plotting (``--plot``). An
episode whose session expired (the run's lease time passed with nothing of it running) or
whose completion failed is dropped with one line saying why, and the agent goes on.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import contextlib
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


# Questions the worked examples answer with the tool (their sums are what the tool returns).
WORKED = [(12, 30), (215, 468), (604, 397)]


def worked_example(count: int = 1) -> list[dict[str, Any]]:
    """``count`` questions answered with the tool, as the conversation's first turns."""
    turns: list[dict[str, Any]] = []
    for i, (a, b) in enumerate(WORKED[:count]):
        call = {
            "id": f"call_{i}",
            "type": "function",
            "function": {
                "name": "calculator",
                "arguments": json.dumps({"expression": f"{a} + {b}"}),
            },
        }
        turns += [
            {"role": "user", "content": f"What is {a} + {b}?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": str(a + b)},
            {"role": "assistant", "content": str(a + b)},
        ]
    return turns


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


def answered(answer: str, total: int) -> bool:
    """Whether the answer's last number is the sum."""
    numbers = re.findall(r"-?\d+", answer.replace(",", ""))
    return bool(numbers) and int(numbers[-1]) == total


def called_right(call: Any, a: int, b: int) -> bool:
    """Whether a tool call is a well-formed calculator call with the question's numbers
    whose result is the sum (what the model has to learn before it can copy the result)."""
    if call.function.name != "calculator":
        return False
    try:
        expression = json.loads(call.function.arguments or "{}").get("expression")
    except (json.JSONDecodeError, AttributeError):
        return False
    if not isinstance(expression, str):
        return False
    numbers = sorted(int(n) for n in re.findall(r"\d+", expression))
    return numbers == sorted((a, b)) and calculate(expression) == str(a + b)


async def open_session(http: httpx.AsyncClient, group_size: int) -> str:
    """An RL session, waiting out 429s (the staleness budget is full until a step trains)."""
    while True:
        r = await http.post("/rl/sessions", json={"group_size": group_size})
        if r.status_code != 429:
            r.raise_for_status()
            return str(r.json()["session_id"])
        await asyncio.sleep(float(r.headers.get("Retry-After", "1")))


class EpisodeDropped(Exception):
    """An episode that cannot be trained on: its session ended before its reward was sent
    (its lease ran out: HTTP 409; the gateway restarted and forgot it: 404), or one of its
    completions failed (a 5xx, a timeout on a busy machine)."""


async def episode(
    http: httpx.AsyncClient, base_url: str, rng: random.Random, args: argparse.Namespace
) -> dict[str, Any]:
    """One session: a question, ``n`` replies, each carried through its tool calls, rewarded
    1 for the right answer and 0 otherwise; :class:`EpisodeDropped` when it cannot be
    trained on."""
    a, b = rng.randrange(100, 1000), rng.randrange(100, 1000)
    sid = await open_session(http, args.n)
    client = openai.AsyncOpenAI(
        base_url=f"{base_url}/v1",
        api_key="unused",
        # A failed completion drops the episode (below) instead of waiting out retries: a
        # retry of a 409 is a 409 again, and one of a timeout may time out again.
        max_retries=0,
        # As long as the gateway's own limit (gateway.generate_timeout_s): on a busy machine
        # a completion can take many minutes.
        timeout=1800.0,
        default_headers={"X-Session-Id": sid},
    )
    messages: list[Any] = [
        {"role": "system", "content": SYSTEM},
        *worked_example(args.worked),
        {"role": "user", "content": f"What is {a} + {b}?"},
    ]

    async def carry_on(choice: Any, policy: str) -> tuple[str, bool, bool, bool, str]:
        """Runs the reply's tool calls until it answers; (completion id, answered right,
        called the tool, called it right, policy)."""
        history, called, good_call = list(messages), False, False
        reply, cid = choice.message, choice.completion_id
        for _ in range(args.tool_rounds):
            if not reply.tool_calls:
                break
            called = True
            good_call = good_call or any(called_right(c, a, b) for c in reply.tool_calls)
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
                again.system_fingerprint or policy,
            )
        return cid, answered(reply.content or "", a + b), called, good_call, policy

    try:
        first = await client.chat.completions.create(
            model="policy",
            messages=messages,
            tools=[CALCULATOR],  # type: ignore[list-item]
            n=args.n,
            max_tokens=48,
            temperature=1.0,
        )
        results = await asyncio.gather(
            *(carry_on(c, first.system_fingerprint or "") for c in first.choices)
        )
        rewards = {cid: float(right) for cid, right, _, _, _ in results}
        reply = await http.post(f"/rl/sessions/{sid}/reward", json={"rewards": rewards})
        if reply.status_code in (404, 409):
            raise EpisodeDropped(reply.json()["error"]["message"])
        reply.raise_for_status()
    except (openai.ConflictError, openai.NotFoundError) as exc:
        # 409: the lease ran out; 404: the gateway restarted and forgot the session.
        raise EpisodeDropped(str(exc.message)) from None
    except (openai.APIStatusError, openai.APITimeoutError) as exc:
        # The session is still open: give its lease back so another episode can use it.
        with contextlib.suppress(httpx.HTTPError):
            await http.delete(f"/rl/sessions/{sid}")
        raise EpisodeDropped(f"a completion failed: {exc}") from None
    finally:
        await client.close()
    return {
        "t": time.time(),
        "reward": sum(rewards.values()) / len(rewards),
        "right": sum(r[1] for r in results) / len(results),
        "tool_rate": sum(r[2] for r in results) / len(results),
        "call_right": sum(r[3] for r in results) / len(results),
        "policy": results[-1][4],
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
                except EpisodeDropped as exc:
                    # Its replies can no longer be trained on: drop the episode, go on.
                    print(f"episode dropped: {exc}", flush=True)
                    continue
                record["t"] -= start
                done.append(record)
                if log is not None:
                    log.write(json.dumps(record) + "\n")
                    log.flush()
                if len(done) % 16 == 0:
                    window = done[-16:]

                    def mean(key: str, part: list[dict[str, Any]] = window) -> float:
                        return sum(r[key] for r in part) / len(part)

                    print(
                        f"{len(done):>5} episodes, {record['t']:6.0f} s: last 16 mean reward "
                        f"{mean('reward'):.3f}, answers right {mean('right'):.2f}, replies "
                        f"calling the tool {mean('tool_rate'):.2f} ({record['policy']})",
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
    parser.add_argument(
        "--worked", type=int, default=len(WORKED), help=f"worked examples (1-{len(WORKED)})"
    )
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
