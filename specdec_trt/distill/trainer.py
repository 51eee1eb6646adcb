"""Knowledge distillation of the draft against the teacher's sparse labels: the loss, the held-out
acceptance estimate, and a resumable, deterministic training loop.

Loss: forward KL(p || q) at temperature T, with p the teacher's top-k distribution renormalised over the
tokens the draft can emit (its pruned vocabulary), and q the draft's distribution over that vocabulary.
Held-out figures (temperature 1): the expected acceptance sum_x min(p(x), q(x)) (Leviathan et al.,
Theorem 3.5; summed over the teacher's top-k, so a slight lower bound) and the greedy match rate (the
draft's argmax equals the teacher's).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel

from specdec_trt.distill.labels import TeacherLabels


@dataclass(frozen=True)
class TrainSettings:
    """Optimisation settings; ``eval_every`` is also how often the resumable state is saved."""

    steps: int = 1500
    batch_size: int = 8
    learning_rate: float = 2e-3
    warmup_steps: int = 30
    kd_temperature: float = 1.0
    eval_every: int = 100
    seed: int = 0


@dataclass(frozen=True)
class Evaluation:
    """Held-out figures at one step."""

    step: int
    kl: float
    acceptance: float
    greedy_match: float


class DistillTrainer:
    """Trains ``draft`` (only its parameters that require gradients) on ``train``; evaluates on ``holdout``
    and keeps the weights of the best held-out acceptance seen (``restore_best``: a small draft trained for
    many epochs on a small corpus overfits, and its held-out acceptance then falls).

    The batch of step s is fixed by the seed and s alone (epoch e is a seeded permutation), so a run
    resumed from its saved state continues exactly as if it had never stopped."""

    def __init__(
        self,
        draft: PreTrainedModel,
        train: TeacherLabels,
        holdout: TeacherLabels,
        draft_vocab: Sequence[int] | None,
        settings: TrainSettings,
        state_file: Path | None = None,
    ) -> None:
        self.draft, self.train_labels, self.holdout, self.settings = draft, train, holdout, settings
        self.state_file = state_file
        self.device = draft.device
        vocab_size = draft.config.vocab_size
        kept = torch.arange(vocab_size) if draft_vocab is None else torch.tensor(list(draft_vocab))
        self.kept = kept.to(self.device)
        self.column_of = torch.full((vocab_size,), -1, dtype=torch.int64)
        self.column_of[kept] = torch.arange(len(kept))
        self.column_of = self.column_of.to(self.device)
        self.head = draft.get_output_embeddings().weight.detach()[self.kept]
        self.parameters = [p for p in draft.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.parameters, lr=settings.learning_rate, betas=(0.9, 0.95))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._learning_rate_factor)
        self.step = 0
        self.losses: list[float] = []
        self.evaluations: list[Evaluation] = []
        self.best: Evaluation | None = None
        self.best_weights: dict[str, torch.Tensor] = {}
        self._permutations: dict[int, torch.Tensor] = {}

    def _learning_rate_factor(self, step: int) -> float:
        """Linear warm-up, then cosine decay to a tenth."""
        warmup, total = self.settings.warmup_steps, self.settings.steps
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    def batch_rows(self, step: int) -> torch.Tensor:
        """The chunk indices of step ``step``: a slice of the seeded permutations, epoch after epoch."""
        count, size = len(self.train_labels), self.settings.batch_size
        rows = []
        for position in range(step * size, (step + 1) * size):
            epoch = position // count
            if epoch not in self._permutations:
                generator = torch.Generator().manual_seed(self.settings.seed * 1_000_003 + epoch)
                self._permutations[epoch] = torch.randperm(count, generator=generator)
            rows.append(self._permutations[epoch][position % count])
        return torch.stack(rows)

    def _draft_logits(self, labels: TeacherLabels) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft's logits over its vocabulary at every real position [n, V_draft], and that mask."""
        width = int(labels.lengths.max())
        tokens = labels.tokens[:, :width].to(self.device)
        mask = labels.mask()[:, :width].to(self.device)
        hidden = self.draft.model(input_ids=tokens, attention_mask=mask.long()).last_hidden_state
        return hidden[mask] @ self.head.T, mask

    def _teacher(self, labels: TeacherLabels, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The teacher's top-k at real positions: draft-vocabulary columns (-1 outside it), logits, and
        exact probabilities."""
        width = mask.shape[1]
        mask = mask.cpu()
        ids = labels.top_ids[:, :width][mask].long().to(self.device)
        logits = labels.top_logits[:, :width][mask].to(self.device)
        probs = (labels.top_logits[:, :width] - labels.logsumexp[:, :width, None])[mask].exp().to(self.device)
        return self.column_of[ids], logits, probs

    def loss(self, labels: TeacherLabels) -> torch.Tensor:
        """Mean forward KL(p_T || q_T) over the real positions of ``labels``."""
        draft_logits, mask = self._draft_logits(labels)
        columns, teacher_logits, _ = self._teacher(labels, mask)
        temperature = self.settings.kd_temperature
        present = columns >= 0
        p = (teacher_logits / temperature).masked_fill(~present, float("-inf")).softmax(-1).nan_to_num(0.0)
        log_q = (draft_logits / temperature).log_softmax(-1).gather(-1, columns.clamp(min=0))
        log_p = p.clamp(min=1e-30).log()
        kl = (p * (log_p - log_q)).masked_fill(~present, 0.0).sum(-1)
        return kl.mean()

    @torch.no_grad()
    def evaluate(self, batch_size: int = 16) -> Evaluation:
        """KL, expected acceptance and greedy match on the held-out chunks (temperature 1)."""
        self.draft.eval()
        totals = torch.zeros(3, dtype=torch.float64)
        positions = 0
        for start in range(0, len(self.holdout), batch_size):
            labels = self.holdout.subset(torch.arange(start, min(start + batch_size, len(self.holdout))))
            draft_logits, mask = self._draft_logits(labels)
            columns, teacher_logits, p = self._teacher(labels, mask)
            present = columns >= 0
            q = draft_logits.softmax(-1).gather(-1, columns.clamp(min=0)) * present
            acceptance = torch.minimum(p, q).sum(-1)
            teacher_top1 = labels.top_ids[:, : mask.shape[1], 0][mask.cpu()].long().to(self.device)
            greedy = self.kept[draft_logits.argmax(-1)] == teacher_top1
            kl = (p * (p.clamp(min=1e-30).log() - q.clamp(min=1e-30).log())).masked_fill(~present, 0.0).sum(-1)
            totals += torch.stack([kl.sum(), acceptance.sum(), greedy.sum()]).double().cpu()
            positions += len(acceptance)
        self.draft.train()
        kl, acceptance, greedy = (totals / positions).tolist()
        return Evaluation(self.step, kl, acceptance, greedy)

    def train(self, on_step: Callable[[DistillTrainer], None] = lambda trainer: None) -> list[Evaluation]:
        """Run (or continue) to ``settings.steps``; evaluates and saves the state every ``eval_every``
        steps and at the end. Returns every evaluation so far."""
        if not self.evaluations:
            self._record(self.evaluate())
        while self.step < self.settings.steps:
            loss = self.loss(self.train_labels.subset(self.batch_rows(self.step)))
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.parameters, 1.0)
            self.optimizer.step()
            self.scheduler.step()
            self.step += 1
            self.losses.append(float(loss.detach()))
            if self.step % self.settings.eval_every == 0 or self.step == self.settings.steps:
                self._record(self.evaluate())
                self.save_state()
            on_step(self)
        return self.evaluations

    def _record(self, evaluation: Evaluation) -> None:
        self.evaluations.append(evaluation)
        if self.best is None or evaluation.acceptance > self.best.acceptance:
            self.best = evaluation
            self.best_weights = {k: v.detach().clone() for k, v in self._trainable_weights().items()}

    def restore_best(self) -> Evaluation:
        """Load the weights of the best held-out acceptance seen; returns that evaluation."""
        if self.best is None:
            raise RuntimeError("nothing was evaluated yet")
        self.draft.load_state_dict(self.best_weights, strict=False)
        return self.best

    def _trainable_weights(self) -> dict[str, torch.Tensor]:
        trainable = {name for name, p in self.draft.named_parameters() if p.requires_grad}
        return {k: v for k, v in self.draft.state_dict().items() if k in trainable}

    def save_state(self) -> None:
        """Write the resumable state (trainable weights, optimiser, schedule, history) atomically."""
        if self.state_file is None:
            return
        state = {
            "step": self.step,
            "weights": self._trainable_weights(),
            "best": self.best.__dict__ if self.best else None,
            "best_weights": self.best_weights,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "losses": self.losses,
            "evaluations": [e.__dict__ for e in self.evaluations],
        }
        partial = self.state_file.with_name(self.state_file.name + ".partial")
        torch.save(state, partial)
        os.replace(partial, self.state_file)

    def load_state(self) -> None:
        """Continue from the saved state."""
        state = torch.load(self.state_file, map_location=self.device, weights_only=True)
        self.draft.load_state_dict(state["weights"], strict=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]
        self.losses = state["losses"]
        self.evaluations = [Evaluation(**e) for e in state["evaluations"]]
        self.best = Evaluation(**state["best"]) if state["best"] else None
        self.best_weights = state["best_weights"]
