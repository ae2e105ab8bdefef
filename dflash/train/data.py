"""Training data for a draft: the target's own greedy answers to a prompt set, generated with the
dflash engine in batches and appended to a JSONL file as they finish (so generation resumes)."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from tqdm import tqdm


def load_prompts(path) -> list[str]:
    """Prompts from a JSONL file: the `question` (GSM8K), `prompt` or `text` field of each line.
    A line that is not such a row is an error naming it: it would fail later, past loading the
    target, or not at all (a string row's substring test)."""
    prompts = []
    with open(path, "rb") as f:   # bytes: a line that is not UTF-8 is named like any other
        for n, raw in enumerate(f, 1):
            where = f"{path}:{n}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError(f"{where} is not UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where} is not JSON ({e})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where} is not a JSON object")
            for key in ("question", "prompt", "text"):
                if key in row:
                    if not isinstance(row[key], str):
                        raise ValueError(f"{where}: {key!r} is not a string")
                    prompts.append(row[key])
                    break
            else:
                raise ValueError(f"{where} has no 'question', 'prompt' or 'text' field")
    if not prompts:
        raise ValueError(f"{path} has no prompts")
    return prompts


def number_variants(prompts: list[str], count: int, seed: int = 0) -> list[tuple[int, str]]:
    """`count` variants of every prompt with each run of digits re-drawn (same number of digits,
    no leading zero): more questions of the same kinds, whose answers the target computes anew.
    Returns (source index, text) pairs, variant-major; a prompt without digits has no variants.
    Variant j of prompt i depends only on (seed, j, i), so reruns reproduce the same texts."""
    variants = []
    for j in range(count):
        for i, text in enumerate(prompts):
            rng = random.Random(f"{seed}:{j}:{i}")
            redrawn = _DIGITS.sub(lambda m, rng=rng: _redraw(len(m[0]), rng), text)
            if redrawn != text:
                variants.append((i, redrawn))
    return variants


_DIGITS = re.compile(r"\d+")


def _redraw(digits: int, rng: random.Random) -> str:
    return str(rng.randint(1 if digits == 1 else 10 ** (digits - 1), 10**digits - 1))


def generate_answers(llm, prompts: list[str], out_path, max_tokens: int = 384,
                     chunk: int = 64, chat: bool = True) -> None:
    """Append {"index", "prompt_ids", "answer_ids"} for every prompt not yet in `out_path`."""
    from ..sampling import SamplingParams

    out_path = Path(out_path)
    rows = read_answers(out_path) if out_path.exists() else []
    _check_resumed_rows(llm, prompts, rows, out_path, chat)
    done = {row["index"] for row in rows}
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


def _check_resumed_rows(llm, prompts: list[str], rows: list[dict], out_path: Path,
                        chat: bool) -> None:
    """Rows already in `out_path` must answer the prompts now at their index: a file from a run
    with another prompt list would otherwise pass its answers off as these prompts' answers."""
    for row in rows:
        i = row["index"]
        if i < len(prompts) and row["prompt_ids"] != llm.encode(
                llm.chat_prompt(prompts[i]) if chat else prompts[i]):
            raise ValueError(f"{out_path}: the answer with index {i} was generated for another "
                             f"prompt than prompt {i} of this run (a run with other "
                             f"--num-prompts or --number-variants?): use another output directory")


def check_generation(path, settings: dict) -> None:
    """Record in `path` what a run directory's answers (and so its feature cache and checkpoint)
    are generated with: target, dtype, quantization, lengths. A rerun with others is refused: it
    would train on the first run's answers, and a shared tokenizer passes _check_resumed_rows."""
    path = Path(path)
    if not path.exists():
        path.write_text(json.dumps(settings) + "\n")
    elif (first := json.loads(path.read_text())) != settings:
        raise ValueError(f"{path.parent}: its answers were generated with {first}, not "
                         f"{settings}: use another output directory (or, if it is the same "
                         f"target moved, delete {path})")


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
