"""The model card of an exported draft, generated from its training metadata.

Every checkpoint writes `training.json` next to the exported weights (the recipe, data counts,
progress log, the reproducing command and the lineage of warm starts) and renders `README.md` and
`training_curve.png` from it; `write_model_card(directory)` regenerates both from that file alone.
A run started with `--init-from DIR` inherits DIR's lineage and appends DIR's own run as a stage,
so a draft grown over several runs lists every run that led to it, oldest first.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

METADATA = "training.json"
RECIPE_KEYS = ("num_layers", "intermediate_size", "block_size", "mask_token_id",
               "target_layer_ids", "gamma", "lr", "min_lr_ratio", "weight_decay", "warmup_steps",
               "total_steps", "seqs_per_step", "anchors_per_seq", "grad_clip",
               "draft_vocab_size", "init_from", "init_from_target_layers", "seed")


def training_metadata(tc, log: list[dict], train_rows: list[dict], heldout_rows: list[dict],
                      target_name: str, command: str | None,
                      lineage: list[dict] | None = None) -> dict:
    """The metadata a model card is rendered from (what `training.json` holds)."""
    evals = [e for e in log if "heldout_tau" in e]
    return {
        "target": target_name,
        "recipe": {k: v for k, v in asdict(tc).items() if k in RECIPE_KEYS},
        "data": {"training_answers": len(train_rows),
                 "answer_tokens": sum(len(r["answer_ids"]) for r in train_rows),
                 "heldout_answers": len(heldout_rows)},
        "last": log[-1] if log else None,
        "evals": [{k: e[k] for k in ("step", "elapsed_s", "loss", "heldout_tau")} for e in evals],
        "command": command,
        "lineage": list(lineage or []),
        "prepare": [],       # shell lines to run before `command` (e.g. restoring answers)
        "stage_notes": [],   # how this run departs from its command, if it does
        "notes": [],         # anything else the card should say
    }


def stage_of(meta: dict) -> dict:
    """One lineage entry summarizing the run that `meta` describes."""
    last, evals = meta.get("last"), meta.get("evals") or []
    return {"command": meta.get("command"),
            "steps": last["step"] if last else 0,
            "total_steps": meta["recipe"]["total_steps"],
            "num_layers": meta["recipe"]["num_layers"],
            "training_answers": meta["data"]["training_answers"],
            "heldout_tau": evals[-1]["heldout_tau"] if evals else None,
            "prepare": meta.get("prepare", []), "notes": meta.get("stage_notes", [])}


def inherited_lineage(init_from) -> list[dict]:
    """The lineage a run warm-started from `init_from` continues: the source's own lineage plus
    the source's run (empty when the source carries no training metadata)."""
    if not init_from or not (Path(init_from) / METADATA).exists():
        return []
    source = json.loads((Path(init_from) / METADATA).read_text())
    return [*source.get("lineage", []), stage_of(source)]


def save_training_metadata(directory, meta: dict) -> None:
    Path(directory, METADATA).write_text(json.dumps(meta, indent=2) + "\n")


def render_model_card(meta: dict) -> str:
    """README.md of a draft, from its training metadata alone."""
    recipe, data, last, evals = meta["recipe"], meta["data"], meta.get("last"), meta["evals"]
    lines = [
        f"# DFlash draft for {meta['target']}",
        "",
        "A block-diffusion draft (DFlashDraftModel format, docs/design.md section 2) trained with "
        "`dflash train`: it proposes blocks of "
        f"{recipe['block_size']} tokens from the target's captured hidden states.",
        "",
        "## Data",
        f"- {data['training_answers']} training answers ({data['answer_tokens']} answer tokens) "
        f"and {data['heldout_answers']} held-out answers: the target's own greedy answers (chat "
        "template) generated with the dflash engine.",
        "",
        "## Recipe",
        "| setting | value |",
        "| --- | --- |",
        *[f"| {k} | {v} |" for k, v in recipe.items()],
        "",
        "## Progress",
    ]
    if last is None:
        lines.append("Not trained yet.")
    else:
        lines += [
            f"- steps: {last['step']} of {recipe['total_steps']}, training time "
            f"{last['elapsed_s'] / 3600:.2f} h",
            f"- final training loss (weighted cross-entropy): {last['loss']:.3f}",
            "- training accuracy per block position 1..{}: {}".format(
                len(last["acc_per_position"]),
                " ".join(f"{a:.2f}" for a in last["acc_per_position"])),
        ]
        if evals:
            lines += ["", "Held-out acceptance length tau (greedy, simulated from the draft's "
                      "block predictions on the held-out answers):", "",
                      "| step | hours | training loss | held-out tau |",
                      "| --- | --- | --- | --- |",
                      *[f"| {e['step']} | {e['elapsed_s'] / 3600:.2f} | {e['loss']:.3f} | "
                        f"{e['heldout_tau']:.3f} |" for e in evals],
                      "", "![training curve](training_curve.png)"]
    stages = [*meta.get("lineage", []), stage_of(meta)]
    if len(stages) > 1:
        lines += ["", "## Lineage", "",
                  f"This draft is stage {len(stages)} of a chain of warm starts: each stage "
                  "starts from the previous stage's exported draft (`--init-from`).", "",
                  "| stage | layers | steps | training answers | held-out tau |",
                  "| --- | --- | --- | --- | --- |",
                  *[f"| {i} | {s['num_layers']} | {s['steps']} of {s['total_steps']} | "
                    f"{s['training_answers']} | "
                    f"{'-' if s['heldout_tau'] is None else format(s['heldout_tau'], '.3f')} |"
                    for i, s in enumerate(stages, 1)]]
    if any(s["command"] for s in stages):
        lines += ["", "## Reproduce", ""]
        if len(stages) > 1:
            lines += ["Run the stages in order from the repository root (each command is "
                      "resumable: rerun it to continue after an interruption).", ""]
        for i, s in enumerate(stages, 1):
            if len(stages) > 1:
                lines += [f"Stage {i}:", ""]
            lines += ["```", *s.get("prepare", []), s["command"], "```", ""]
            lines += [f"- {note}" for note in s.get("notes", [])]
            if s.get("notes"):
                lines.append("")
        if len(stages) == 1:
            lines.append("(resumable: rerun the same command to continue after an interruption)")
        while lines[-1] == "":
            lines.pop()
    if meta.get("notes"):
        lines += ["", "## Notes", *[f"- {note}" for note in meta["notes"]]]
    return "\n".join(lines) + "\n"


def write_model_card(directory, plot: bool = True) -> None:
    """(Re)write README.md and training_curve.png of `directory` from its training.json."""
    directory = Path(directory)
    meta = json.loads((directory / METADATA).read_text())
    (directory / "README.md").write_text(render_model_card(meta))
    if plot and meta["evals"]:
        _plot(meta["evals"], directory / "training_curve.png")


def _plot(evals: list[dict], path: Path) -> None:
    from .._optional import pyplot

    plt = pyplot("train", "the model card's training curve")

    fig, left = plt.subplots(figsize=(6, 3.5))
    hours = [e["elapsed_s"] / 3600 for e in evals]
    left.plot(hours, [e["heldout_tau"] for e in evals], "o-", color="tab:blue")
    left.set_xlabel("training hours")
    left.set_ylabel("held-out tau", color="tab:blue")
    right = left.twinx()
    right.plot(hours, [e["loss"] for e in evals], "s--", color="tab:red")
    right.set_ylabel("training loss", color="tab:red")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
