"""DPO (Rafailov et al. 2023) as a ``compute_loss`` provider — the HF recipe overrides
``Trainer.compute_loss``; here it is a plugin.

A frozen copy of the policy, taken when the loop is built (before any step), is the reference.
For each pair, with sequence log-probabilities of the completions (prompt tokens masked):

    loss = -log sigmoid(beta * ((pi_chosen - ref_chosen) - (pi_rejected - ref_rejected)))

averaged over the pairs. The loss is a per-pair mean, so this ``compute_loss`` does not take
``num_items_in_batch``: the loop divides it by the micro-batches of a step. Reward statistics
(``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``, ``rewards/accuracies``, as TRL names
them) are averaged over each logging window and across processes, and added to the logs.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from corelooper import hookimpl

SECTION = "dpo"
_STATS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")


@hookimpl
def corelooper_config_sections():
    return {SECTION: {"beta": 0.1}}


def sequence_logps(model, batch) -> torch.Tensor:
    """Sum of the log-probabilities of the label tokens of each row (labels -100 are skipped)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logits, labels = logits[:, :-1, :].float(), batch["labels"][:, 1:]
    mask = labels != -100
    logp = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (logp * mask).sum(-1)


def dpo_loss(pi_chosen, pi_rejected, ref_chosen, ref_rejected, beta: float):
    """Per-pair losses and the implicit rewards of chosen and rejected completions."""
    chosen_rewards = beta * (pi_chosen - ref_chosen)
    rejected_rewards = beta * (pi_rejected - ref_rejected)
    losses = -F.logsigmoid(chosen_rewards - rejected_rewards)
    return losses, chosen_rewards.detach(), rejected_rewards.detach()


@hookimpl
def corelooper_configure(plugins):
    plugins.register(DPO(), "dpo.run")  # per run: its reference model and reward window


class DPO:
    def __init__(self) -> None:
        self.reference = None
        self.window = None  # summed reward statistics since the last log (on the device)
        self.logs: dict[str, float] = {}

    def on_init_end(self, loop) -> None:
        self.reference = copy.deepcopy(loop.model).eval()
        self.reference.requires_grad_(False)

    def _reference(self, device):
        if next(self.reference.parameters()).device != device:
            self.reference.to(device)
        return self.reference

    def compute_loss(self, loop, model, batch, return_outputs):
        beta = float(loop.config.section(SECTION)["beta"])
        n = batch["input_ids"].shape[0] // 2
        logps = sequence_logps(model, batch)
        with torch.no_grad():
            ref_logps = sequence_logps(self._reference(batch["input_ids"].device), batch)
        losses, chosen, rejected = dpo_loss(logps[:n], logps[n:], ref_logps[:n], ref_logps[n:], beta)
        loss = losses.mean()
        if model.training:
            stats = torch.stack(
                [
                    chosen.sum(),
                    rejected.sum(),
                    (chosen - rejected).sum(),
                    (chosen > rejected).float().sum(),
                    torch.tensor(float(n), device=chosen.device),
                ]
            )
            self.window = stats if self.window is None else self.window + stats
        return (loss, {"logps": logps.detach()}) if return_outputs else loss

    def on_step_end(self, loop, control) -> None:
        # Every process takes part in the reduction; only the main process logs.
        if control.should_log and self.window is not None:
            total = loop.backend.reduce_sum(self.window)
            means = (total[:4] / total[4].clamp(min=1)).tolist()
            self.logs = {k: round(v, 6) for k, v in zip(_STATS, means, strict=True)}
            self.window = None

    @hookimpl(tryfirst=True)
    def on_log(self, logs) -> None:
        if self.logs and "loss" in logs:
            logs.update(self.logs)
            self.logs = {}
