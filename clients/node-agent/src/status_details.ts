// Reads google.rpc.RetryInfo from a gRPC error's `grpc-status-details-bin` trailer (a
// serialized google.rpc.Status). Decoded by hand with the protobuf wire reader: three small
// messages, not worth generating google/rpc/*.proto for.
//
//   google.rpc.Status   { int32 code = 1; string message = 2; repeated google.protobuf.Any details = 3; }
//   google.protobuf.Any { string type_url = 1; bytes value = 2; }
//   google.rpc.RetryInfo { google.protobuf.Duration retry_delay = 1; }
//   google.protobuf.Duration { int64 seconds = 1; int32 nanos = 2; }

import { BinaryReader, WireType } from "@bufbuild/protobuf/wire";
import type { ServiceError } from "@grpc/grpc-js";

const RETRY_INFO = "type.googleapis.com/google.rpc.RetryInfo";

interface Any {
  typeUrl: string;
  value: Uint8Array;
}

function statusDetails(bytes: Uint8Array): Any[] {
  const reader = new BinaryReader(bytes);
  const details: Any[] = [];
  while (reader.pos < reader.len) {
    const [field, wireType] = reader.tag();
    if (field === 3 && wireType === WireType.LengthDelimited) {
      const any = new BinaryReader(reader.bytes());
      const item: Any = { typeUrl: "", value: new Uint8Array() };
      while (any.pos < any.len) {
        const [f, w] = any.tag();
        if (f === 1 && w === WireType.LengthDelimited) item.typeUrl = any.string();
        else if (f === 2 && w === WireType.LengthDelimited) item.value = any.bytes();
        else any.skip(w);
      }
      details.push(item);
    } else {
      reader.skip(wireType);
    }
  }
  return details;
}

function retryDelayMs(retryInfo: Uint8Array): number | undefined {
  const reader = new BinaryReader(retryInfo);
  while (reader.pos < reader.len) {
    const [field, wireType] = reader.tag();
    if (field === 1 && wireType === WireType.LengthDelimited) {
      const duration = new BinaryReader(reader.bytes());
      let seconds = 0;
      let nanos = 0;
      while (duration.pos < duration.len) {
        const [f, w] = duration.tag();
        if (f === 1 && w === WireType.Varint) seconds = Number(duration.int64());
        else if (f === 2 && w === WireType.Varint) nanos = duration.int32();
        else duration.skip(w);
      }
      return seconds * 1000 + nanos / 1e6;
    }
    reader.skip(wireType);
  }
  return undefined;
}

/** The RetryInfo delay of `err` in milliseconds, or undefined when it carries none. */
export function retryDelayOf(err: ServiceError): number | undefined {
  const raw = err.metadata?.get("grpc-status-details-bin") ?? [];
  for (const value of raw) {
    if (typeof value === "string") continue;
    try {
      for (const detail of statusDetails(value)) {
        if (detail.typeUrl === RETRY_INFO) return retryDelayMs(detail.value);
      }
    } catch {
      return undefined; // Malformed details: fall back to the caller's default delay.
    }
  }
  return undefined;
}
