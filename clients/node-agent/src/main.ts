// An external agent in Node: takes a rollout lease from the coordinator, generates with the
// rollout server the lease names, scores the samples itself, and submits them as a typed
// TrajectoryGroup under the lease. One JSON line per episode on stdout; progress on stderr.
// Tracing: the agent has no tracing SDK; it forwards the W3C trace context of the lease (the
// coordinator's lease span) into Generate and into every trajectory, so the rollout server's
// generate span, the coordinator's submission span and the training step that trains the
// group join the lease's trace.
//
//   node clients/node-agent/dist/clients/node-agent/src/main.js \
//     --coordinator 127.0.0.1:50051 --episodes 4 --group-size 4

import { parseArgs } from "node:util";

import { credentials, Metadata, status as Code, type ServiceError } from "@grpc/grpc-js";

import { type TraceContext, Trajectory, TrajectoryGroup } from "../../../generated/ts/arealgrpc/v1/common";
import {
  AcquireRolloutRequest,
  type AcquireRolloutResponse,
  CoordinatorServiceClient,
  ReleaseRolloutRequest,
  type RolloutLease,
  SubmitTrajectoriesRequest,
  SubmitTrajectoriesResponse,
} from "../../../generated/ts/arealgrpc/v1/coordinator";
import {
  type Completion,
  GenerateRequest,
  type GenerateResponse,
  RolloutServiceClient,
} from "../../../generated/ts/arealgrpc/v1/rollout";
import { retryDelayOf } from "./status_details";
import { first3Prompt, type Prompt, reward, rng } from "./task";
import { decode, encode } from "./tokenizer";

const DEFAULT_RETRY_MS = 1000;
const RPC_TIMEOUT_MS = 60_000;

interface Options {
  coordinator: string;
  episodes: number;
  groupSize: number;
  producerId: string;
  seed: number;
  maxNewTokens: number;
  temperature: number;
  acquireTimeoutS: number;
}

const USAGE = `usage: main.js --coordinator HOST:PORT [--episodes N] [--group-size G]
  [--producer-id ID] [--seed S] [--max-new-tokens T] [--temperature X] [--acquire-timeout-s S]`;

function parseOptions(argv: string[]): Options {
  const { values } = parseArgs({
    args: argv,
    strict: true,
    options: {
      coordinator: { type: "string" },
      episodes: { type: "string", default: "1" },
      "group-size": { type: "string", default: "4" },
      "producer-id": { type: "string", default: `node-agent-${process.pid}` },
      seed: { type: "string", default: "0" },
      "max-new-tokens": { type: "string", default: "2" },
      temperature: { type: "string", default: "1.0" },
      "acquire-timeout-s": { type: "string", default: "120" },
      help: { type: "boolean", default: false },
    },
  });
  if (values.help) {
    console.log(USAGE);
    process.exit(0);
  }
  if (!values.coordinator) throw new UsageError("--coordinator HOST:PORT is required");
  const int = (name: string, raw: string, min: number): number => {
    const n = Number(raw);
    if (!Number.isInteger(n) || n < min) throw new UsageError(`--${name} must be an integer >= ${min}, got ${raw}`);
    return n;
  };
  const num = (name: string, raw: string, min: number): number => {
    const n = Number(raw);
    if (!Number.isFinite(n) || n < min) throw new UsageError(`--${name} must be a number >= ${min}, got ${raw}`);
    return n;
  };
  return {
    coordinator: values.coordinator,
    episodes: int("episodes", values.episodes!, 1),
    groupSize: int("group-size", values["group-size"]!, 1),
    producerId: values["producer-id"]!,
    seed: int("seed", values.seed!, 0),
    maxNewTokens: int("max-new-tokens", values["max-new-tokens"]!, 1),
    temperature: num("temperature", values.temperature!, 0),
    acquireTimeoutS: num("acquire-timeout-s", values["acquire-timeout-s"]!, 0),
  };
}

class UsageError extends Error {}

function log(message: string): void {
  process.stderr.write(`node-agent: ${message}\n`);
}

function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

function deadline(): Date {
  return new Date(Date.now() + RPC_TIMEOUT_MS);
}

function isServiceError(err: unknown): err is ServiceError {
  return err instanceof Error && typeof (err as ServiceError).code === "number";
}

function describe(err: unknown): string {
  if (isServiceError(err)) return `${Code[err.code] ?? err.code}: ${err.details}`;
  return err instanceof Error ? err.message : String(err);
}

/** Waits until the channel of `client` is connected (fails after `timeoutMs`). */
function waitReady(client: { waitForReady(d: Date, cb: (e?: Error) => void): void }, timeoutMs: number): Promise<void> {
  return new Promise((resolve, reject) =>
    client.waitForReady(new Date(Date.now() + timeoutMs), (err) => (err ? reject(err) : resolve())),
  );
}

/** A lease, retrying RESOURCE_EXHAUSTED after the server's RetryInfo delay (or a default). */
async function acquireLease(coord: CoordinatorServiceClient, opts: Options): Promise<RolloutLease> {
  const giveUpAt = Date.now() + opts.acquireTimeoutS * 1000;
  for (let attempt = 1; ; attempt++) {
    try {
      const reply = await new Promise<AcquireRolloutResponse>((resolve, reject) =>
        coord.acquireRollout(
          AcquireRolloutRequest.fromPartial({ producerId: opts.producerId, groupSize: opts.groupSize }),
          new Metadata(),
          { deadline: deadline() },
          (err, res) => (err ? reject(err) : resolve(res)),
        ),
      );
      if (!reply.lease) throw new Error("AcquireRollout returned no lease");
      return reply.lease;
    } catch (err) {
      if (!isServiceError(err) || err.code !== Code.RESOURCE_EXHAUSTED) throw err;
      const delay = retryDelayOf(err) ?? DEFAULT_RETRY_MS;
      if (Date.now() + delay > giveUpAt) {
        throw new Error(`no rollout capacity after ${attempt} attempt(s) in ${opts.acquireTimeoutS} s: ${err.details}`);
      }
      // The first refusal and then every tenth, so a long wait does not flood the log.
      if (attempt % 10 === 1) log(`no capacity (${err.details}); retrying in ${delay} ms (attempt ${attempt})`);
      await sleep(delay);
    }
  }
}

function releaseLease(coord: CoordinatorServiceClient, leaseId: string): Promise<void> {
  return new Promise((resolve) =>
    coord.releaseRollout(ReleaseRolloutRequest.fromPartial({ leaseId }), new Metadata(), { deadline: deadline() }, (err) => {
      if (err) log(`ReleaseRollout(${leaseId}) failed: ${describe(err)}`);
      resolve();
    }),
  );
}

/** The trace id (32 hex digits) of a W3C traceparent, or "" when there is none. */
function traceIdOf(tc: TraceContext | undefined): string {
  const m = /^[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}$/.exec(tc?.traceparent ?? "");
  return m ? m[1] : "";
}

function generate(
  rollout: RolloutServiceClient,
  inputIds: number[],
  opts: Options,
  requestId: string,
  traceContext: TraceContext | undefined,
): Promise<GenerateResponse> {
  return new Promise((resolve, reject) =>
    // fromPartial: fields the contract adds later keep their defaults instead of breaking this.
    rollout.generate(
      GenerateRequest.fromPartial({
        inputIds,
        sampling: {
          temperature: opts.temperature,
          topP: undefined,
          topK: 0,
          maxNewTokens: opts.maxNewTokens,
          stopTokenIds: [],
          nSamples: opts.groupSize,
          ignoreEos: false,
          topLogprobs: 0,
        },
        requestId,
        // The server's generate span becomes a child of the lease's span.
        traceContext,
      }),
      new Metadata(),
      { deadline: deadline() },
      (err, res) => (err ? reject(err) : resolve(res)),
    ),
  );
}

/** One sample as a Trajectory: prompt positions carry logprob 0, version -1, no loss. */
function toTrajectory(
  prompt: number[],
  c: Completion,
  r: number,
  taskId: string,
  groupId: string,
  traceContext: TraceContext | undefined,
): Trajectory {
  const n = c.outputIds.length;
  if (c.outputLogprobs.length !== n || c.outputVersions.length !== n) {
    throw new Error(`completion fields disagree: ${n} ids, ${c.outputLogprobs.length} logprobs, ${c.outputVersions.length} versions`);
  }
  return Trajectory.fromPartial({
    tokenIds: [...prompt, ...c.outputIds],
    logprobs: [...prompt.map(() => 0), ...c.outputLogprobs],
    versions: [...prompt.map(() => -1), ...c.outputVersions],
    lossMask: [...prompt.map(() => false), ...c.outputIds.map(() => true)],
    reward: r,
    promptLength: prompt.length,
    taskId,
    groupId,
    // The coordinator parents its submission span on it, and the training step links to it.
    traceContext,
    finishReason: c.finishReason,
  });
}

function submit(
  coord: CoordinatorServiceClient,
  leaseId: string,
  group: TrajectoryGroup,
): Promise<SubmitTrajectoriesResponse> {
  return new Promise((resolve, reject) => {
    const call = coord.submitTrajectories(new Metadata(), { deadline: deadline() }, (err, res) =>
      err ? reject(err) : resolve(res),
    );
    call.write(SubmitTrajectoriesRequest.fromPartial({ leaseId, group }));
    call.end();
  });
}

interface EpisodeResult {
  episode: number;
  lease_id: string;
  trace_id: string;
  policy_version: number;
  rollout_address: string;
  prompt: string;
  answer: string;
  completions: string[];
  rewards: number[];
  response: unknown;
}

async function episode(
  index: number,
  coord: CoordinatorServiceClient,
  rollouts: Map<string, RolloutServiceClient>,
  prompt: Prompt,
  opts: Options,
): Promise<{ result: EpisodeResult; reply: SubmitTrajectoriesResponse }> {
  const lease = await acquireLease(coord, opts);
  const leaseId = lease.leaseId;
  let group: TrajectoryGroup;
  let completions: string[];
  try {
    if (!lease.rolloutAddress) {
      throw new Error("the lease names no rollout_address: no rollout server is registered with the coordinator");
    }
    let rollout = rollouts.get(lease.rolloutAddress);
    if (rollout === undefined) {
      rollout = new RolloutServiceClient(lease.rolloutAddress, credentials.createInsecure());
      rollouts.set(lease.rolloutAddress, rollout);
    }
    const promptIds = encode(prompt.text);
    const generated = await generate(rollout, promptIds, opts, leaseId, lease.traceContext);
    if (generated.completions.length !== opts.groupSize) {
      throw new Error(`Generate returned ${generated.completions.length} completions, asked for ${opts.groupSize}`);
    }
    const groupId = `${leaseId}-g`;
    const trajectories = generated.completions.map((c) =>
      toTrajectory(
        promptIds,
        c,
        reward(decode(c.outputIds.slice(0, 1)), prompt.answer),
        leaseId,
        groupId,
        lease.traceContext,
      ),
    );
    group = TrajectoryGroup.fromPartial({ taskId: leaseId, groupId, trajectories });
    completions = generated.completions.map((c) => decode(c.outputIds));
  } catch (err) {
    // The lease's capacity is freed at once instead of at its deadline.
    await releaseLease(coord, leaseId);
    throw err;
  }
  const reply = await submit(coord, leaseId, group);
  return {
    reply,
    result: {
      episode: index,
      lease_id: leaseId,
      trace_id: traceIdOf(lease.traceContext),
      policy_version: lease.policyVersion,
      rollout_address: lease.rolloutAddress,
      prompt: prompt.text,
      answer: prompt.answer,
      completions,
      rewards: group.trajectories.map((t) => t.reward),
      response: SubmitTrajectoriesResponse.toJSON(reply),
    },
  };
}

async function main(): Promise<number> {
  let opts: Options;
  try {
    opts = parseOptions(process.argv.slice(2));
  } catch (err) {
    log(`${err instanceof Error ? err.message : String(err)}\n${USAGE}`);
    return 2;
  }
  const coord = new CoordinatorServiceClient(opts.coordinator, credentials.createInsecure());
  const rollouts = new Map<string, RolloutServiceClient>();
  const next = rng(opts.seed);
  let rejected = 0;
  try {
    await waitReady(coord, 30_000);
    for (let i = 0; i < opts.episodes; i++) {
      const { result, reply } = await episode(i, coord, rollouts, first3Prompt(next), opts);
      process.stdout.write(JSON.stringify(result) + "\n");
      for (const r of reply.rejections) log(`group under ${r.leaseId} rejected: ${r.reason}`);
      if (reply.acceptedGroups !== 1) rejected += 1;
    }
  } catch (err) {
    log(`failed: ${describe(err)}`);
    return 1;
  } finally {
    coord.close();
    for (const r of rollouts.values()) r.close();
  }
  if (rejected > 0) {
    log(`${rejected} of ${opts.episodes} group(s) were not accepted`);
    return 1;
  }
  return 0;
}

main().then(
  (code) => {
    process.exitCode = code;
  },
  (err) => {
    log(`failed: ${describe(err)}`);
    process.exitCode = 1;
  },
);
