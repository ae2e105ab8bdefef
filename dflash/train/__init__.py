"""Draft training: data generation with the engine, the DFlash objective, the resumable loop."""

from .data import (
    check_generation,
    generate_answers,
    load_prompts,
    number_variants,
    read_answers,
)
from .trainer import TrainConfig, Trainer, check_options, heldout_tau, init_draft

__all__ = ["TrainConfig", "Trainer", "check_generation", "check_options", "generate_answers",
           "heldout_tau", "init_draft", "load_prompts", "number_variants", "read_answers"]
