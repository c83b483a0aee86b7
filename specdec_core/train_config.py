"""TrainConfig: how a draft is trained (optimiser steps, batch, learning rate, evaluations), the
one source of every training default -- the library's (specdec_core.train), the CLI's flags and
the retraining DAG's Params read these fields. No torch: a DAG file's parse imports it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainConfig:
    steps: int = 200
    batch_size: int = 8
    lr: float = 5e-4
    weight_decay: float = 0.01
    warmup_steps: int = 20
    max_grad_norm: float = 1.0
    eval_every: int = 50
    k_max: int = 8
    max_length: int = 512
    teacher_topk: int = 0            # > 0: KL from the target's top-k distribution
    seed: int = 0
