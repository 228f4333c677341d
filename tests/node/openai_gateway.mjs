// Drives areal-gateway with the official `openai` npm package, as a Node agent would: takes an
// RL session, asks a chat completion (plain and streamed) in it, rewards it. Prints one JSON
// line with what it saw. Usage: node openai_gateway.mjs http://127.0.0.1:<port>
import OpenAI from "openai";

const base = process.argv[2];
const session = await fetch(`${base}/rl/sessions`, {
  method: "POST",
  headers: { "content-type": "application/json" },
  body: JSON.stringify({ group_size: 1 }),
}).then((r) => r.json());
const client = new OpenAI({
  baseURL: `${base}/v1`,
  apiKey: "unused",
  maxRetries: 0,
  defaultHeaders: { "X-Session-Id": session.session_id },
});
const messages = [{ role: "user", content: "hi" }];
const plain = await client.chat.completions.create({ model: "m", messages, max_tokens: 4 });
let streamed = "";
let chunks = 0;
const stream = await client.chat.completions.create({
  model: "m",
  messages: [...messages, { role: "assistant", content: plain.choices[0].message.content }, { role: "user", content: "again" }],
  max_tokens: 4,
  stream: true,
});
for await (const chunk of stream) {
  chunks += 1;
  streamed += chunk.choices[0]?.delta?.content ?? "";
}
let badParam = null;
try {
  await client.chat.completions.create({ model: "m", messages, n: 0 });
} catch (err) {
  badParam = { status: err.status, param: err.param ?? err.error?.param ?? null };
}
const reward = await fetch(`${base}/rl/sessions/${session.session_id}/reward`, {
  method: "POST",
  headers: { "content-type": "application/json" },
  body: JSON.stringify({ reward: 1.0 }),
}).then((r) => r.json());
console.log(
  JSON.stringify({
    session_id: session.session_id,
    finish_reason: plain.choices[0].finish_reason,
    chunks,
    streamed_length: streamed.length,
    bad: badParam,
    reward,
  }),
);
