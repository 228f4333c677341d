// The built-in "first3" task, seen from outside: prompt "abc=", answer "a" (the first
// letter). The agent makes its own prompts and scores them itself.

export interface Prompt {
  text: string;
  answer: string;
}

/** A small deterministic PRNG (mulberry32), so a seed gives the same prompts every run. */
export function rng(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

const LETTERS = "abcdefghijklmnopqrstuvwxyz";

/** A "first3" prompt: three random lowercase letters and "=". */
export function first3Prompt(next: () => number): Prompt {
  let word = "";
  for (let i = 0; i < 3; i++) word += LETTERS[Math.floor(next() * LETTERS.length)];
  return { text: `${word}=`, answer: word[0] };
}

/** 1.0 when the first generated token decodes to the answer, else 0.0. */
export function reward(firstTokenText: string, answer: string): number {
  return firstTokenText === answer ? 1.0 : 0.0;
}
