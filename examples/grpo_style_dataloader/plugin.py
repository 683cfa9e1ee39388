"""GRPO-style training as two hook implementations: a ``train_dataloader`` provider that loads
``steps_per_generation`` batches at once and generates completions for them in one call, and a
``compute_loss`` provider with GRPO's clipped, group-relative objective.

Per generation batch (``per_device_train_batch_size * steps_per_generation`` rows): each prompt
gets ``num_generations`` sampled completions from the current policy; reward = the similarity of
the completion's text to the true end of the line (``difflib`` ratio); advantage = reward normalised within the prompt's group, (r - mean) / (std + 1e-4). The old
per-token log-probabilities are recorded then, so later steps on the same generation use
PPO clipping (``epsilon``). The loss is token-normalised by ``num_items_in_batch`` (completion
tokens of the step). No KL term (beta = 0, as TRL's default).
"""

from __future__ import annotations

import torch

from corelooper import hookimpl
from corelooper.data.loader import BatchLoader
from corelooper.errors import ConfigError

from .loader import GenerationBatchLoader

SECTION = "grpo"


@hookimpl
def corelooper_config_sections():
    return {
        SECTION: {
            "steps_per_generation": 4,
            "num_generations": 4,
            "max_new_tokens": 12,
            "temperature": 1.0,
            "epsilon": 0.2,
        }
    }


def token_logps(model, input_ids, attention_mask, labels) -> torch.Tensor:
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1, :].float()
    return torch.log_softmax(logits, -1).gather(-1, labels[:, 1:].clamp(min=0).unsqueeze(-1)).squeeze(-1)


def reward(text: str, answer: str) -> float:
    """Similarity of the completion to the true end of the line (difflib ratio, 0..1): dense
    enough that a group of sampled completions differs in reward from the first step."""
    import difflib

    return difflib.SequenceMatcher(None, text[: len(answer)], answer, autojunk=False).ratio()


def make_generate(loop, cfg: dict, recent: dict):
    from examples.causal_lm.data import EOS_ID, PAD_ID, tokenizer

    G = cfg["num_generations"]
    tok_args = loop.config.data.args

    @torch.no_grad()
    def generate(samples: list[dict]) -> dict[str, torch.Tensor]:
        model = loop.backend.unwrap_model(loop.model)
        tok = tokenizer(
            tuple(tok_args.get("packages", ("json", "email"))),
            tok_args.get("vocab_size", 1024),
            tok_args.get("eval_every", 8),
        )
        prompts = [s["prompt_ids"] for s in samples for _ in range(G)]
        P = max(map(len, prompts))
        ids = torch.full((len(prompts), P), PAD_ID, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding: generation continues every row at the end
            ids[i, P - len(p) :] = torch.tensor(p)
            mask[i, P - len(p) :] = 1
        device = loop.backend.device
        was_training = model.training
        model.eval()
        seqs = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            do_sample=True,
            temperature=cfg["temperature"],
            max_new_tokens=cfg["max_new_tokens"],
            pad_token_id=PAD_ID,
            eos_token_id=EOS_ID,
            use_cache=True,
        )
        model.train(was_training)
        completion = seqs[:, P:]
        # Completion tokens up to and including the first EOS are trained; the rest is padding.
        after_eos = (completion == EOS_ID).long().cumsum(-1) - (completion == EOS_ID).long() > 0
        comp_mask = (~after_eos).long()
        attention = torch.cat([mask.to(device), comp_mask], 1)
        labels = torch.cat(
            [torch.full_like(ids, -100).to(device), completion.masked_fill(after_eos, -100)], 1
        )
        rewards = torch.tensor(
            [
                reward(tok.decode(c[m.bool()].tolist()), s["answer"])
                for c, m, s in zip(completion, comp_mask, [s for s in samples for _ in range(G)], strict=True)
            ],
            device=device,
        )
        groups = rewards.view(-1, G)
        adv = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).view(-1)
        old = token_logps(model, seqs, attention, labels)
        recent["reward"] = rewards.mean().item()
        return {
            "input_ids": seqs,
            "attention_mask": attention,
            "labels": labels,
            "advantages": adv,
            "old_logps": old,
        }

    return generate


@hookimpl
def corelooper_configure(plugins):
    plugins.register(GRPO(), "grpo.run")  # per run: it remembers the latest generation's reward


class GRPO:
    def __init__(self) -> None:
        self.recent: dict[str, float] = {}

    def train_dataloader(self, loop, dataset):
        cfg = loop.config.section(SECTION)
        a, k, G = loop.args, cfg["steps_per_generation"], cfg["num_generations"]
        rows = a.per_device_train_batch_size * k
        if rows % G:
            raise ConfigError(
                f"grpo: per_device_train_batch_size * steps_per_generation ({rows}) must be a multiple "
                f"of grpo.num_generations ({G}): every prompt's group must sit in one generation batch."
            )
        inner = BatchLoader(
            dataset,
            rows // G,
            collate_fn=list,
            shuffle=True,
            seed=a.data_seed if a.data_seed is not None else a.seed,
            drop_last=True,
            num_replicas=loop.backend.num_processes,
            rank=loop.backend.process_index,
        )
        return GenerationBatchLoader(inner, k, make_generate(loop, cfg, self.recent))

    def compute_loss(self, loop, model, batch, num_items_in_batch, return_outputs):
        eps = loop.config.section(SECTION)["epsilon"]
        logps = token_logps(model, batch["input_ids"], batch["attention_mask"], batch["labels"])
        mask = (batch["labels"][:, 1:] != -100).to(logps.dtype)
        ratio = torch.exp(logps - batch["old_logps"])
        adv = batch["advantages"].unsqueeze(1)
        per_token = -torch.min(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)
        loss = (per_token * mask).sum() / num_items_in_batch
        return (loss, None) if return_outputs else loss

    @hookimpl(tryfirst=True)
    def on_log(self, logs):
        if "loss" in logs and "reward" in self.recent:
            logs["reward"] = round(self.recent["reward"], 6)
