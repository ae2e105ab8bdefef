"""The model card of an exported draft: data, recipe, progress and the reproducing command, written
next to the weights (README.md + training_curve.png) at every checkpoint."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

RECIPE_KEYS = ("num_layers", "intermediate_size", "block_size", "mask_token_id",
               "target_layer_ids", "gamma", "lr", "min_lr_ratio", "weight_decay", "warmup_steps",
               "total_steps", "seqs_per_step", "anchors_per_seq", "grad_clip",
               "draft_vocab_size", "init_from", "init_from_target_layers", "seed")


def write_model_card(directory, tc, log: list[dict], train_rows: list[dict],
                     heldout_rows: list[dict], target_name: str, command: str | None) -> None:
    directory = Path(directory)
    recipe = {k: v for k, v in asdict(tc).items() if k in RECIPE_KEYS}
    tokens = sum(len(r["answer_ids"]) for r in train_rows)
    last = log[-1] if log else None
    evals = [e for e in log if "heldout_tau" in e]
    lines = [
        f"# DFlash draft for {target_name}",
        "",
        "A block-diffusion draft (SPEC section 2, DFlashDraftModel format) trained with "
        "`dflash train`: it proposes blocks of "
        f"{tc.block_size} tokens from the target's captured hidden states.",
        "",
        "## Data",
        f"- {len(train_rows)} training answers ({tokens} answer tokens) and {len(heldout_rows)} "
        "held-out answers: the target's own greedy answers (chat template) generated with the "
        "dflash engine.",
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
            f"- steps: {last['step']} of {tc.total_steps}, training time "
            f"{last['elapsed_s'] / 3600:.2f} h on the machine that ran it",
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
            _plot(evals, directory / "training_curve.png")
    if command:
        lines += ["", "## Reproduce", "", "```", command, "```",
                  "", "(resumable: rerun the same command to continue after an interruption)"]
    (directory / "README.md").write_text("\n".join(lines) + "\n")


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
