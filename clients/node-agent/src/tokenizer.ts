// The built-in model's byte tokenizer (ByT5 layout): ids 0-2 are pad, eos, unk; byte b is
// id b + 3. Enough for the built-in tasks; a real model's tokenizer would come from its files.

export const PAD_ID = 0;
export const EOS_ID = 1;
const OFFSET = 3;

/** Token ids of `text`: its UTF-8 bytes, each + 3. */
export function encode(text: string): number[] {
  return Array.from(Buffer.from(text, "utf8"), (b) => b + OFFSET);
}

/** Text of `ids`, skipping special and out-of-byte-range ids. */
export function decode(ids: readonly number[]): string {
  const bytes = ids.filter((id) => id >= OFFSET && id < OFFSET + 256).map((id) => id - OFFSET);
  return Buffer.from(bytes).toString("utf8");
}
