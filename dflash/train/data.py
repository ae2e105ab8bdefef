"""Training data for a draft: the target's own greedy answers to a prompt set, generated with the
dflash engine in batches and appended to a JSONL file as they finish (so generation resumes)."""

from __future__ import annotations

import json
from pathlib import Path

from tqdm import tqdm


def load_prompts(path) -> list[str]:
    """Prompts from a JSONL file: the `question` (GSM8K), `prompt` or `text` field of each line."""
    prompts = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            for key in ("question", "prompt", "text"):
                if key in row:
                    prompts.append(row[key])
                    break
            else:
                raise ValueError(f"{path}:{n} has no 'question', 'prompt' or 'text' field")
    return prompts


def generate_answers(llm, prompts: list[str], out_path, max_tokens: int = 384,
                     chunk: int = 64, chat: bool = True) -> None:
    """Append {"index", "prompt_ids", "answer_ids"} for every prompt not yet in `out_path`."""
    from ..sampling import SamplingParams

    out_path = Path(out_path)
    done = {row["index"] for row in read_answers(out_path)} if out_path.exists() else set()
    todo = [i for i in range(len(prompts)) if i not in done]
    params = SamplingParams(max_tokens=max_tokens)
    if out_path.exists() and not out_path.read_bytes().endswith(b"\n"):
        with open(out_path, "a") as out:   # a torn last line (killed mid-write) stays apart
            out.write("\n")
    with open(out_path, "a") as out, tqdm(total=len(prompts), initial=len(done),
                                          desc="answers", unit="prompt") as bar:
        for start in range(0, len(todo), chunk):
            batch = todo[start:start + chunk]
            texts = [llm.chat_prompt(prompts[i]) if chat else prompts[i] for i in batch]
            for i, o in zip(batch, llm.generate(texts, params)):
                out.write(json.dumps({"index": i, "prompt_ids": o.prompt_token_ids,
                                      "answer_ids": o.token_ids}) + "\n")
            out.flush()
            bar.update(len(batch))


def read_answers(path) -> list[dict]:
    """Rows written by generate_answers; a torn last line (killed mid-write) is skipped."""
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows
